"""Tests for rollplex_train.tracking: loggers, timing, checkpoints, HF export, progress bar."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rollplex_train.tracking import (
    POINTER_FILE,
    CheckpointManager,
    ProgressBar,
    Tracker,
    compute_throughput,
    export_hf,
    load_json,
    load_torch,
    read_metrics_jsonl,
    save_json,
    save_torch,
    timer,
    timing_metrics,
)
from rollplex_train.tracking.loggers import wandb_mode_from_env


# ---- loggers -----------------------------------------------------------------------------------
def test_unknown_logger_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bogus"):
        Tracker(["console", "bogus"], tmp_path, "p", "e", {})
    assert not (tmp_path / "metrics.jsonl").exists()


def test_jsonl_values_nan_and_resume_append(tmp_path: Path) -> None:
    with Tracker(["jsonl"], tmp_path, "p", "e", {}) as tracker:
        tracker.log({"critic/score/mean": 0.5, "loss": torch.tensor(1.25), "n": np.int64(3)}, step=1)
        tracker.log({"critic/score/mean": float("nan"), "x": float("inf")}, step=2)
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first == {"step": 1, "critic/score/mean": 0.5, "loss": 1.25, "n": 3.0}
    second = json.loads(lines[1])  # strict JSON: non-finite -> null
    assert second == {"step": 2, "critic/score/mean": None, "x": None}

    # A crash mid-line after step 3 was logged; the checkpoint is at step 1: the resumed run cuts
    # the file back to step 1 and logs step 2 again, so every step appears once.
    with open(path, "a") as f:
        f.write('{"step": 3, "x": 1.0}\n{"step": 4, "trunc')
    with Tracker(["jsonl"], tmp_path, "p", "e", {}, resume_step=1) as tracker:
        tracker.log({"critic/score/mean": 0.75}, step=2)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads(lines[0]) == first and json.loads(lines[1])["critic/score/mean"] == 0.75

    # A fresh run (resume disabled) in the same directory starts a new file, keeping one backup.
    with Tracker(["jsonl"], tmp_path, "p", "e", {}) as tracker:
        tracker.log({"critic/score/mean": 0.1}, step=1)
    assert [r["step"] for r in read_metrics_jsonl(path)] == [1]
    assert len((tmp_path / "metrics.jsonl.prev").read_text().splitlines()) == 2


def test_resume_keeps_one_tensorboard_history(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(["tensorboard"], tmp_path, "p", "e", {"lr": 1.0}) as tracker:
        for step in (1, 2, 3, 4):  # crashed after step 4, last checkpoint at step 2
            tracker.log({"critic/score/mean": float(step)}, step=step)
    with Tracker(["tensorboard"], tmp_path, "p", "e", {"lr": 1.0}, resume_step=2) as tracker:
        for step in (3, 4, 5):
            tracker.log({"critic/score/mean": 10.0 * step}, step=step)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("critic/score/mean")]
    assert got == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]


def test_non_numeric_metric_names_key(tmp_path: Path) -> None:
    with Tracker(["jsonl"], tmp_path, "p", "e", {}) as tracker:
        with pytest.raises(ValueError, match="bad/key"):
            tracker.log({"bad/key": "text"}, step=0)


def test_console_line_key_metrics_first(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = {
        "zzz": 1.0,
        "val/score": 0.25,
        "response_length/mean": 100.0,
        "actor/kl_loss": 0.001,
        "timing_s/step": 2.5,
        "critic/score/mean": 0.5,
    }
    with caplog.at_level(logging.INFO, logger="rollplex_train.metrics"):
        with Tracker(["console"], tmp_path, "p", "e", {}) as tracker:
            tracker.log(metrics, step=7)
    lines = [r.getMessage() for r in caplog.records if r.name == "rollplex_train.metrics"]
    assert lines == ["step 7 | score 0.5 | step_s 2.5 | kl_loss 0.001 | resp_len 100 | val/score 0.25"]


def test_tensorboard_scalar_readback(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(["tensorboard"], tmp_path, "p", "e", {"lr": 1e-6}) as tracker:
        tracker.log({"critic/score/mean": 0.5}, step=1)
        tracker.log({"critic/score/mean": 0.75}, step=2)
    tb_dir = tmp_path / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in tb_dir.iterdir())
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    events = acc.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in events] == [(1, 0.5), (2, 0.75)]


def test_wandb_mode_from_env(tmp_path: Path) -> None:
    empty = {"HOME": str(tmp_path)}  # no ~/.netrc there
    assert wandb_mode_from_env(empty) == "offline"
    assert wandb_mode_from_env({**empty, "WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode_from_env({**empty, "WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode_from_env({**empty, "WANDB_MODE": "disabled"}) == "disabled"
    # `wandb login` stores the key in ~/.netrc: online without WANDB_API_KEY
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_mode_from_env(empty) == "online"
    assert wandb_mode_from_env({**empty, "WANDB_BASE_URL": "https://wandb.example.org"}) == "offline"  # other host
    other = tmp_path / "other_netrc"
    other.write_text("machine wandb.example.org login user password " + "k" * 40 + "\n")
    assert wandb_mode_from_env({**empty, "NETRC": str(other), "WANDB_BASE_URL": "https://wandb.example.org"}) == "online"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login")  # malformed: no login
    assert wandb_mode_from_env(empty) == "offline"


def _isolated_wandb_env(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("NETRC", raising=False)
    # Any network attempt goes to a closed local port and fails at once.
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    # Set (not delete) so that monkeypatch restores them after Tracker overrides them.
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / "should_not_be_used"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_unreachable_server_falls_back_offline_within_the_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _isolated_wandb_env(monkeypatch, tmp_path / "home")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # online requested, server unreachable
    out = tmp_path / "run"
    start_s = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="rollplex_train.tracking.wandb_run"):
        tracker = Tracker(["wandb"], out, "proj", "exp", {}, wandb_run_id="fallback1", wandb_init_timeout_s=3.0)
    init_s = time.perf_counter() - start_s
    tracker.log({"critic/score/mean": 0.5}, step=1)
    tracker.close()
    assert init_s < 3.0 + 15.0  # bounded by the timeout (plus the offline start), not wandb's 90 s
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "online start failed" in warnings[0] and "127.0.0.1:9" in warnings[0]
    assert tracker.wandb_run_id == "fallback1"
    assert [p.name.endswith("-fallback1") for p in (out / "wandb" / "wandb").glob("offline-run-*")] == [True]


def test_wandb_resume_continues_the_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _isolated_wandb_env(monkeypatch, tmp_path / "home")
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    first = Tracker(["wandb"], out, "proj", "exp", {})
    run_id = first.wandb_run_id
    first.close()
    assert isinstance(run_id, str) and len(run_id) == 8
    resumed = Tracker(["wandb"], out, "proj", "exp", {}, resume_step=3, wandb_run_id=run_id)
    resumed.close()
    assert resumed.wandb_run_id == run_id
    runs = sorted(p.name for p in (out / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in name for name in runs)  # "-1" added within one second


def test_wandb_offline_stays_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    _isolated_wandb_env(monkeypatch, home)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    attempts: list[object] = []
    real_connect = socket.socket.connect

    def guarded_connect(self: socket.socket, address: object) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0] if isinstance(address, tuple) else address
            if host not in ("127.0.0.1", "::1", "localhost"):
                attempts.append(address)
                raise OSError(f"network access attempted: {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    out = tmp_path / "run"
    start_s = time.perf_counter()
    tracker = Tracker(["wandb"], out, "proj", "exp", {"lr": 1e-6})
    init_s = time.perf_counter() - start_s
    tracker.log({"critic/score/mean": 0.5}, step=1)
    tracker.close()
    assert attempts == []
    runs = list((out / "wandb").rglob("offline-run-*"))
    assert runs, "no offline run directory under output_dir/wandb"
    assert list(runs[0].glob("*.wandb"))
    assert list(home.iterdir()) == []  # nothing in ~/.config, ~/.cache, ~/.netrc or old WANDB_* dirs
    assert os.environ["WANDB_DIR"] == str(out / "wandb")
    assert init_s < 30.0  # no network wait (wandb's own is 90 s); a loaded machine's service start is slow


# ---- timing and progress -----------------------------------------------------------------------
def test_timer_accumulates_and_survives_errors() -> None:
    timings: dict[str, float] = {}
    with timer("gen", timings):
        time.sleep(0.01)
    with timer("gen", timings):
        time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with timer("fail", timings):
            raise RuntimeError("boom")
    assert timings["gen"] >= 0.02
    assert "fail" in timings
    assert set(timing_metrics(timings)) == {"timing_s/gen", "timing_s/fail"}


def test_compute_throughput() -> None:
    assert compute_throughput(1000, 2.0, 4) == pytest.approx(125.0)
    for args in ((1, 0.0, 1), (1, 1.0, 0), (-1, 1.0, 1), (1, float("nan"), 1)):
        with pytest.raises(ValueError):
            compute_throughput(*args)


def test_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    with ProgressBar(total=3, initial=0, enabled=False) as bar:
        bar.update({"critic/score/mean": 0.5, "timing_s/step": 1.0})
    assert capsys.readouterr() == ("", "")
    with ProgressBar(total=3, initial=1, enabled=True, interactive=True) as bar:
        bar.update({"critic/score/mean": 0.5, "timing_s/step": 1.25})
        assert bar._bar.n == 2
        bar.update({"critic/score/mean": float("nan")})
    err = capsys.readouterr().err
    assert "score=0.5" in err and "step_s=1.2" in err


def test_progress_bar_prints_log_lines_above_itself(capsys: pytest.CaptureFixture[str]) -> None:
    import re
    import sys

    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)  # a console handler as Hydra's job logging installs
    root.addHandler(handler)
    try:
        with ProgressBar(total=3, enabled=True, interactive=True) as bar:
            bar.update({"critic/score/mean": 0.5})
            logging.getLogger("rollplex_train.test").warning("a log line")
            bar.update({"critic/score/mean": 0.6})
        logging.getLogger("rollplex_train.test").warning("after the bar")
        assert root.handlers[-1] is handler  # the redirect is undone at close
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    segments = [seg for seg in re.split(r"[\r\n]", err) if "a log line" in seg]
    assert segments == ["a log line"]  # on its own line, not glued to the bar's text
    assert "after the bar\n" in err


def test_progress_without_a_terminal_is_a_log_line_now_and_then(capsys, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="rollplex_train.tracking.progress"):
        with ProgressBar(total=40, initial=0, enabled=True, interactive=False) as bar:
            for step in range(1, 41):
                bar.update({"critic/score/mean": 0.5, "timing_s/step": float(step)})
    assert capsys.readouterr().err == ""  # no carriage-return frames
    assert [r.getMessage() for r in caplog.records] == [f"train {k}/40 score=0.5 step_s={k:.1f}" for k in range(2, 41, 2)]


# ---- checkpoints -------------------------------------------------------------------------------
def _writer(value: float):
    def write(tmp: Path) -> None:
        save_torch({"w": torch.full((4,), value)}, tmp / "actor" / "model.pt")
        save_json({"step_value": value}, tmp / "trainer_state.json")

    return write


def test_checkpoint_save_latest_and_crash_in_write_fn(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt", max_to_keep=3)
    assert mgr.latest() is None
    first = mgr.save(1, _writer(1.0))
    assert first == tmp_path / "ckpt" / "global_step_1"
    assert (tmp_path / "ckpt" / POINTER_FILE).read_text().strip() == "1"

    def crashing(tmp: Path) -> None:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "model.pt").write_bytes(b"partial")
        raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        mgr.save(2, crashing)
    assert mgr.latest() == first
    assert torch.equal(load_torch(first / "actor" / "model.pt")["w"], torch.full((4,), 1.0))
    assert load_json(first / "trainer_state.json") == {"step_value": 1.0}
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["global_step_1", POINTER_FILE]


def test_checkpoint_hard_crash_leftover_ignored_then_removed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, max_to_keep=2)
    mgr.save(1, _writer(1.0))
    leftover = root / ".tmp-global_step_2-99999"  # a process killed inside write_fn
    leftover.mkdir()
    (leftover / "half.pt").write_bytes(b"x")
    (root / POINTER_FILE).unlink()  # and the pointer lost too
    assert mgr.latest() == root / "global_step_1"
    mgr.save(2, _writer(2.0))
    assert not leftover.exists()
    assert mgr.latest() == root / "global_step_2"


def test_checkpoint_pruning_and_same_step_resave(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, max_to_keep=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, _writer(float(step)))
    assert [p.name for p in mgr.list_checkpoints()] == ["global_step_3", "global_step_4"]
    mgr.save(4, _writer(40.0))  # re-save of the same step replaces it
    assert torch.equal(load_torch(root / "global_step_4" / "actor" / "model.pt")["w"], torch.full((4,), 40.0))
    # A resumed run saving below existing steps: the new one is never pruned.
    mgr1 = CheckpointManager(root, max_to_keep=1)
    new = mgr1.save(2, _writer(2.0))
    assert mgr1.list_checkpoints() == [new]
    assert mgr1.latest() == new
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    with pytest.raises(ValueError):
        CheckpointManager(root, max_to_keep=0)


@pytest.mark.parametrize("content", ["garbage\n", "", "17\n"])
def test_checkpoint_corrupt_pointer_fallback(tmp_path: Path, content: str, caplog) -> None:
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, max_to_keep=3)
    mgr.save(5, _writer(5.0))
    mgr.save(10, _writer(10.0))
    (root / POINTER_FILE).write_text(content)
    with caplog.at_level(logging.WARNING):
        assert mgr.latest() == root / "global_step_10"
    assert any("pointer" in r.getMessage() for r in caplog.records)
    assert CheckpointManager.step_of(mgr.latest()) == 10


def test_resolve_resume_modes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, max_to_keep=2)
    assert mgr.resolve_resume("auto") is None
    saved = mgr.save(3, _writer(3.0))
    assert mgr.resolve_resume("auto") == saved
    assert mgr.resolve_resume("disable") is None
    assert mgr.resolve_resume(str(saved)) == saved
    missing = tmp_path / "nowhere" / "global_step_9"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        mgr.resolve_resume(str(missing))
    with pytest.raises(ValueError):
        mgr.resolve_resume("")
    with pytest.raises(ValueError, match="global_step"):
        CheckpointManager.step_of(tmp_path)


def test_torch_and_json_helpers(tmp_path: Path) -> None:
    state = {"rng_np": np.random.get_state(), "t": torch.arange(3)}
    save_torch(state, tmp_path / "s.pt")  # numpy arrays need the full unpickler: fallback path
    loaded = load_torch(tmp_path / "s.pt")
    assert torch.equal(loaded["t"], torch.arange(3))
    assert np.array_equal(loaded["rng_np"][1], state["rng_np"][1])
    save_torch({"w": torch.ones(2)}, tmp_path / "w.pt")  # the safe path
    assert torch.equal(load_torch(tmp_path / "w.pt")["w"], torch.ones(2))
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_torch(tmp_path / "missing.pt")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_json(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="none.json"):
        load_json(tmp_path / "none.json")


# ---- HF export ---------------------------------------------------------------------------------
def _tiny_model_and_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<s>", "</s>", "hello", "world", "the", "answer", "is", "42"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config), tokenizer


def test_export_hf_round_trip(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = _tiny_model_and_tokenizer()
    source = tmp_path / "source_ckpt"
    source.mkdir()
    (source / "preprocessor_config.json").write_text('{"patch_size": 14}')
    (source / "chat_template.jinja").write_text("{{ messages }}")
    out = tmp_path / "out" / "hf_actor"
    out.parent.mkdir()
    (out.parent / ".tmp-hf_actor-1").mkdir()  # unrelated leftover; export must not care
    out.mkdir()
    (out / "stale.txt").write_text("old export")

    assert export_hf(model, tokenizer, out, extra_files_from=source) == out
    assert not (out / "stale.txt").exists()  # older export replaced as a whole
    assert (out / "preprocessor_config.json").read_text() == '{"patch_size": 14}'
    assert (out / "chat_template.jinja").exists()
    assert list(out.glob("*.safetensors"))
    assert not (out.parent / f".tmp-hf_actor-{os.getpid()}").exists()

    loaded = AutoModelForCausalLM.from_pretrained(out)
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    tok2 = AutoTokenizer.from_pretrained(out)
    assert tok2("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]

    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        export_hf(model, tokenizer, out, extra_files_from=tmp_path / "no_such_dir")
    assert (out / "preprocessor_config.json").exists()  # failed export left the old one intact


def test_val_accuracy_plot(tmp_path: Path) -> None:
    from rollplex_train.tracking.plots import plot_val_accuracy, val_accuracy_curves

    with Tracker(["jsonl"], tmp_path, "p", "e", {}) as tracker:
        tracker.log({"val/accuracy": 0.3, "val/color/accuracy": 0.25, "val/count/accuracy": 0.35}, step=0)
        tracker.log({"critic/score/mean": 0.5}, step=1)
        tracker.log({"val/accuracy": 0.6, "val/color/accuracy": 0.9, "val/count/accuracy": float("nan")}, step=2)
    curves = val_accuracy_curves(read_metrics_jsonl(tmp_path / "metrics.jsonl"))
    assert curves == {"all": [(0, 0.3), (2, 0.6)], "color": [(0, 0.25), (2, 0.9)], "count": [(0, 0.35)]}
    path = plot_val_accuracy(tmp_path)
    assert path == tmp_path / "val_accuracy.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "no_val"
    with Tracker(["jsonl"], empty, "p", "e", {}) as tracker:
        tracker.log({"critic/score/mean": 0.5}, step=1)
    assert plot_val_accuracy(empty) is None and not (empty / "val_accuracy.png").exists()
