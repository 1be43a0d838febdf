"""What a new user meets first, without a cluster: bad rows found up front, finished runs, paths
resolved from any directory, resolvable configs, one-line endings, self-contained rollout dumps."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import CLI, EMBEDDED_CKPT, EMBEDDED_TASKS, ROOT
from rollplex_train.config import Config, DataConfig, ModelConfig, TrainerConfig
from rollplex_train.data.dataset import PromptDataset
from rollplex_train.data.types import Response
from rollplex_train.paths import resolve_config_paths
from rollplex_train.runtime.batching import to_train_batch


def _config(embedded_assets, out: Path, **trainer) -> Config:
    tasks, ckpt = embedded_assets
    return Config(model=ModelConfig(path=str(ckpt)),
                  data=DataConfig(train_files=str(tasks / "train.parquet"), val_files="", rollout_batch_size=4),
                  trainer=TrainerConfig(output_dir=str(out), loggers=["jsonl"], **trainer))


def _bad_rows(tmp_path: Path) -> Path:
    """A manifest of 5 rows: one good, the others bad for different reasons."""
    good = str(EMBEDDED_TASKS / "media" / "color" / "train" / "000000.png")
    rows = [
        {"problem": "<image>Colour?", "answer": "red", "images": [good]},
        {"problem": "<image>Colour?", "answer": "red", "images": ["media/nowhere.png"]},
        {"problem": "<image>Colour?", "answer": "red", "images": [str(tmp_path / "gone.png")]},
        {"problem": "Colour?", "answer": "red", "images": [good]},  # no placeholder for the image
        {"problem": None, "answer": "red", "images": []},
    ]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_rows_are_checked_up_front_with_counts_by_reason(tmp_path, tiny_tokenizer, caplog):
    files = str(_bad_rows(tmp_path))
    dataset = PromptDataset(DataConfig(train_files=files, val_files=""), tiny_tokenizer, files, "train")
    with caplog.at_level(logging.WARNING, logger="rollplex_train.data.dataset"):
        skipped = dataset.precheck()
    assert dict(skipped) == {"missing_media": 2, "placeholder_mismatch": 1, "bad_schema": 1}
    assert dataset.num_bad == 4
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "4 of 5 rows skipped" in warnings[0] and "nowhere.png" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollplex_train.data.dataset"):
        assert [dataset.get(i) is None for i in range(5)] == [False, True, True, True, True]
    assert caplog.records == [] and dict(dataset.skipped) == dict(skipped)  # skipped once, not again


def test_data_without_a_batch_fails_in_one_line_before_any_worker(embedded_assets, tmp_path):
    import ray

    from rollplex_train.trainer import Trainer

    cfg = _config(embedded_assets, tmp_path / "run")
    cfg.data.train_files = str(_bad_rows(tmp_path))
    with pytest.raises(ValueError) as err:
        Trainer(cfg, tmp_path / "run")
    message = str(err.value)
    assert "\n" not in message and message.startswith("data.train_files=")
    assert "1 of 5 rows are usable" in message and "'missing_media': 2" in message
    assert "data.rollout_batch_size=4" in message
    assert not ray.is_initialized()


def test_a_finished_run_says_so(embedded_assets, tmp_path, caplog):
    import ray

    from rollplex_train.trainer import Trainer

    out = tmp_path / "run"
    step_dir = out / "checkpoints" / "global_step_3"
    step_dir.mkdir(parents=True)
    (step_dir / "trainer_state.json").write_text(json.dumps({"step": 3, "wandb_run_id": None}))
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("3")
    trainer = Trainer(_config(embedded_assets, out, total_steps=3), out)
    with caplog.at_level(logging.INFO, logger="rollplex_train.trainer"):
        assert trainer.fit() == {}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "nothing to do" in lines[0] and "global_step_3" in lines[0]
    assert "step 3 and trainer.total_steps=3" in lines[0]
    assert not ray.is_initialized() and not (out / "metrics.jsonl").exists()


def test_a_resume_under_another_lr_schedule_says_so(embedded_assets, tmp_path, caplog):
    from rollplex_train.trainer import Trainer

    out = tmp_path / "run"
    step_dir = out / "checkpoints" / "global_step_3"
    step_dir.mkdir(parents=True)
    cfg = _config(embedded_assets, out, total_steps=6)
    saved = {"lr_scheduler": "cosine", "lr_decay_steps": 12, "lr": cfg.actor.lr}
    (step_dir / "trainer_state.json").write_text(json.dumps({"step": 3, "wandb_run_id": None, "lr_schedule": saved}))
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("3")
    cfg.actor.lr_scheduler, cfg.actor.lr_decay_steps = "cosine", 24  # total_steps raised: a longer decay
    with caplog.at_level(logging.WARNING, logger="rollplex_train.trainer"):
        Trainer(cfg, out)
    assert [r.getMessage() for r in caplog.records] == [
        "resuming under another learning-rate schedule: actor.lr_decay_steps=24 (checkpoint: 12); the new one "
        "applies from step 3 on; set actor.lr_decay_steps=12 to keep the checkpoint's decay"]
    caplog.clear()
    cfg.actor.lr_decay_steps = 12
    with caplog.at_level(logging.WARNING, logger="rollplex_train.trainer"):
        Trainer(cfg, out)
    assert caplog.records == []


def test_default_paths_resolve_from_any_directory(embedded_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config_paths(Config(), ROOT)
    assert cfg.model.path == str(EMBEDDED_CKPT.resolve())
    assert cfg.data.train_files == str((EMBEDDED_TASKS / "train.parquet").resolve())
    (tmp_path / "mine.parquet").write_text("x")  # the working directory wins over the project root
    cfg = resolve_config_paths(Config(data=DataConfig(train_files="mine.parquet,artifacts/data/visual_tasks/val.parquet")),
                               ROOT)
    assert cfg.data.train_files.split(",") == [str(tmp_path / "mine.parquet"),
                                               str((EMBEDDED_TASKS / "val.parquet").resolve())]
    with pytest.raises(FileNotFoundError) as err:
        resolve_config_paths(Config(model=ModelConfig(path="ckpts/none")), ROOT)
    assert str(err.value) == (f"model.path='ckpts/none': not found; tried {tmp_path / 'ckpts/none'} and "
                              f"{ROOT / 'ckpts/none'}")


def test_cli_from_another_directory_names_the_paths_tried(tmp_path):
    proc = subprocess.run([str(CLI), "model.path=ckpts/none", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"rollplex-train: error: model.path='ckpts/none': not found; tried "
                                   f"{tmp_path / 'ckpts/none'} and {ROOT / 'ckpts/none'}")


@pytest.mark.parametrize("override, line", [
    ("actor.lrr=1e-4", "Could not override 'actor.lrr'. Key 'lrr' not in 'ActorConfig'"),
    ("actor.lr=fast", "Error merging override actor.lr=fast Value 'fast' of type 'str' could not be converted to Float"),
    ("schedule=bogus", "In 'config': Could not find 'schedule/bogus'; expected one of: disaggregated, rollplex, serial"),
    ("actor.lr=[1", "override 'actor.lr=[1': no viable alternative at input '[1' See "
                    "https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details"),
    ("=3", "Config group override must be a string or a list. Got int"),
])
def test_config_hydra_cannot_compose_fails_in_one_line(tmp_path, override, line):
    proc = subprocess.run([str(CLI), "+experiment=tiny_cpu", override, "--cfg", "job"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stderr) == (2, f"rollplex-train: error: {line}\n")
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_group_baseline_with_one_response_fails_in_one_line(tmp_path, estimator):
    """A group-baseline estimator with rollout.n=1 would train on zero (or raw-score) advantages:
    refused before Ray starts, both keys named, exit 2."""
    proc = subprocess.run([str(CLI), "+experiment=tiny_cpu", f"algorithm={estimator}", "rollout.n=1",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert (proc.returncode, proc.stderr) == (2, (
        f"rollplex-train: error: rollout.n=1: algorithm.adv_estimator={estimator} takes its baseline from the "
        "other responses of a prompt, so it needs rollout.n >= 2\n"))
    assert "Ray" not in proc.stdout


def test_hydra_record_follows_the_output_dir(tmp_path):
    from rollplex_train.cli import follow_output_dir

    assert follow_output_dir(["prog", "trainer.output_dir=/r", "--cfg", "job"]) == [
        "prog", "trainer.output_dir=/r", "hydra.run.dir=/r", "--cfg", "job"]
    for argv in (["prog", "a=1"], ["prog", "trainer.output_dir=/r", "hydra.run.dir=/h"], ["prog", "trainer.output_dir=null"]):
        assert follow_output_dir(argv) == argv  # nothing to follow, or a run dir of the user's own
    proc = subprocess.run([str(CLI), "+experiment=tiny_cpu", f"trainer.output_dir={tmp_path / 'run'}", "--cfg", "hydra"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"dir: {tmp_path / 'run'}\n" in proc.stdout


def test_every_experiment_config_resolves(tmp_path):
    for experiment in sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")):
        proc = subprocess.run([str(CLI), f"+experiment={experiment}", "--cfg", "job", "--resolve"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (experiment, proc.stderr[-2000:])
        assert "output_dir: null" in proc.stdout and "${" not in proc.stdout, experiment


class _Trainer:
    def __init__(self, step: int, last):
        self.step, self._last = step, last

    def last_checkpoint(self):
        return self._last


def test_interrupt_and_reward_failure_end_in_one_line(capsys):
    from rollplex_train.algo.rewards import RewardFailure
    from rollplex_train.cli import _run_errors
    from rollplex_train.data.loader import NoBatchError
    from rollplex_train.runtime.window import PrefillBudgetError

    with pytest.raises(SystemExit) as end:
        with _run_errors(_Trainer(7, Path("/runs/x/checkpoints/global_step_5"))):
            raise KeyboardInterrupt
    assert end.value.code == 130
    assert capsys.readouterr().err == ("\nrollplex-train: interrupted at step 7; last checkpoint "
                                       "/runs/x/checkpoints/global_step_5 (the same command resumes from it)\n")
    with pytest.raises(SystemExit) as end:
        with _run_errors(_Trainer(1, None)):
            raise KeyboardInterrupt
    assert "interrupted at step 1; no checkpoint was written" in capsys.readouterr().err
    with pytest.raises(SystemExit) as end:
        with _run_errors(_Trainer(2, None)):
            raise RewardFailure("reward.function='f' failed on 8 of 8 samples")
    assert end.value.code == 1
    assert capsys.readouterr().err == "rollplex-train: error: reward.function='f' failed on 8 of 8 samples\n"
    with pytest.raises(SystemExit) as end:
        with _run_errors(_Trainer(3, None)):
            raise NoBatchError("data.train_files: epoch 0 of split 'train' gave no batch of 4")
    assert end.value.code == 2
    assert capsys.readouterr().err == "rollplex-train: error: data.train_files: epoch 0 of split 'train' gave no batch of 4\n"
    with pytest.raises(SystemExit) as end:
        with _run_errors(_Trainer(4, Path("/runs/x/checkpoints/global_step_3"))):
            raise PrefillBudgetError("schedule.prefill_from_actor=true: over schedule.prefix_memory_gib=0.1")
    assert end.value.code == 2
    assert capsys.readouterr().err == ("rollplex-train: error: schedule.prefill_from_actor=true: over "
                                       "schedule.prefix_memory_gib=0.1 (at step 4; last checkpoint "
                                       "/runs/x/checkpoints/global_step_3)\n")


def test_media_and_length_checked_up_front(tmp_path, tiny_tokenizer, caplog):
    """An image whose header PIL cannot read and a prompt longer than ``data.max_prompt_length``
    (text plus the images' tokens from their header sizes) are found by the precheck, before any
    worker; a video counts as at least one token there, so a row within the limit is kept."""
    good = str(EMBEDDED_TASKS / "media" / "color" / "train" / "000000.png")
    (tmp_path / "garbage.png").write_bytes(b"not an image at all")
    rows = [
        {"problem": "<image>Colour?", "answer": "red", "images": [good]},
        {"problem": "<image>Colour?", "answer": "red", "images": [str(tmp_path / "garbage.png")]},
        {"problem": "<image>Colour?" + " please" * 40, "answer": "red", "images": [good]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    files = str(tmp_path / "rows.parquet")
    cfg = DataConfig(train_files=files, val_files="", max_prompt_length=48)
    dataset = PromptDataset(cfg, tiny_tokenizer, files, "train")
    with caplog.at_level(logging.WARNING, logger="rollplex_train.data.dataset"):
        skipped = dataset.precheck()
    assert dict(skipped) == {"corrupt_media": 1, "too_long": 1}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "garbage.png" in warning and "data.max_prompt_length=48" in warning
    sample = dataset.get(0)
    assert sample is not None and sample.prompt_ids.shape[0] <= 48
    # the precheck's length is the loaded prompt's length for images (sizes from headers)
    tight = PromptDataset(DataConfig(train_files=files, val_files="", max_prompt_length=sample.prompt_ids.shape[0]),
                          tiny_tokenizer, files, "train")
    assert tight.precheck()["too_long"] == 1 and tight.get(0) is not None
    shorter = PromptDataset(DataConfig(train_files=files, val_files="", max_prompt_length=sample.prompt_ids.shape[0] - 1),
                            tiny_tokenizer, files, "train")
    assert shorter.precheck()["too_long"] == 2


def test_jsonl_with_a_bad_line_passes_the_precheck(tmp_path, tiny_tokenizer):
    good = str(EMBEDDED_TASKS / "media" / "color" / "train" / "000000.png")
    row = json.dumps({"problem": "<image>Colour?", "answer": "red", "images": [good]})
    path = tmp_path / "rows.jsonl"
    path.write_bytes("\n".join([row, "{broken", row]).encode() + b'\n{"problem": "\xe9\xff"}\n')  # a latin-1 line
    dataset = PromptDataset(DataConfig(train_files=str(path), val_files=""), tiny_tokenizer, str(path), "train")
    assert dict(dataset.precheck()) == {"bad_schema": 2} and dataset.num_bad == 2
    with pytest.raises(ValueError, match=r"line 4 is not UTF-8 text"):
        dataset._tables[0][3]
    (tmp_path / "none.jsonl").write_text('{"problem": "q", "answer": \n')
    with pytest.raises(ValueError, match=r"^no row of .*none.jsonl is a JSON object \(1 bad\); first: .*none.jsonl "
                                         r"line 1 is not valid JSON"):
        PromptDataset(DataConfig(train_files=str(tmp_path / "none.jsonl"), val_files=""), tiny_tokenizer,
                      str(tmp_path / "none.jsonl"), "train")


def test_unreadable_files_and_config_values_are_one_line(tmp_path, tiny_tokenizer, capsys):
    """A file that is not parquet, image bytes that are not an image, a reward spec naming a
    directory and OmegaConf's multi-line messages: one line each."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    from rollplex_train.algo.rewards import load_reward_function
    from rollplex_train.cli import _user_errors
    from rollplex_train.data.vision import image_size

    (tmp_path / "fake.parquet").write_bytes(b"PAR1garbagePAR1")
    with pytest.raises(ValueError, match=r"fake.parquet: cannot read as parquet: ArrowInvalid"):
        PromptDataset(DataConfig(train_files=str(tmp_path / "fake.parquet"), val_files=""), tiny_tokenizer,
                      str(tmp_path / "fake.parquet"), "train")
    with pytest.raises(ValueError) as err:
        image_size({"bytes": b"garbage", "path": "x.png"})
    assert str(err.value) == "corrupt image <bytes of x.png>: cannot identify image file <bytes of x.png>"
    with pytest.raises(ValueError, match=r"is a directory; expected a Python file"):
        load_reward_function(f"{tmp_path}:fn")
    with pytest.raises(SystemExit) as end:
        with _user_errors("rollplex-train"):
            OmegaConf.merge(OmegaConf.structured(DataConfig), {"foo": 1})
    assert end.value.code == 2 and isinstance(end.value.__cause__, ConfigKeyError)
    err_text = capsys.readouterr().err
    assert err_text.startswith("rollplex-train: error: Key 'foo' not in 'DataConfig'; full_key: foo")
    assert err_text.count("\n") == 1


def test_reward_file_that_fails_to_import_is_one_line(tmp_path):
    from rollplex_train.algo.rewards import load_reward_function

    (tmp_path / "imports.py").write_text("import os\nimport no_such_module_here\n")
    (tmp_path / "syntax.py").write_text("def fn(x:\n    pass\n")
    with pytest.raises(ValueError) as err:
        load_reward_function(f"{tmp_path / 'imports.py'}:fn")
    assert str(err.value) == (f"reward.function='{tmp_path / 'imports.py'}:fn': importing '{tmp_path / 'imports.py'}' "
                              f"failed at {tmp_path / 'imports.py'}:2: ModuleNotFoundError: No module named "
                              "'no_such_module_here'")
    with pytest.raises(ValueError, match=rf"failed at {tmp_path / 'syntax.py'}:1: SyntaxError: "):
        load_reward_function(f"{tmp_path / 'syntax.py'}:fn")


def test_rollout_dump_holds_prompt_text_and_media(tmp_path, make_prompts, train_dataset):
    from rollplex_train.tracking.rollouts import dump_rollouts

    prompts = make_prompts(("color", "direction"))
    responses = [Response(prompt_index=i, token_ids=torch.tensor([5, 6]), logprobs=torch.zeros(2), text=f"r{i}",
                          finish_reason="stop") for i in (0, 0, 1, 1)]
    batch = to_train_batch(prompts, responses, pad_id=0)
    path = dump_rollouts(tmp_path / "dumps", 3, batch, responses, torch.tensor([1.0, 0.0, 0.5, 0.0]))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line, prompt in zip(lines, [prompts[0], prompts[0], prompts[1], prompts[1]]):
        file, row = train_dataset.locate(int(prompt.uid.split(":")[1]))
        source = pq.read_table(file).slice(row, 1).to_pylist()[0]  # what the data file holds
        assert line["prompt"] == source["problem"]  # media: the data file's paths, joined to its directory
        assert line["media"] == [str(Path(file).parent / m) for m in source["images"] + source["videos"]]
        assert all(Path(m).is_file() for m in line["media"])
        assert line["uid"] == prompt.uid and line["ground_truth"] == source["answer"]
    assert [r["task"] for r in lines] == ["color", "color", "direction", "direction"]
    assert lines[0]["prompt"].startswith("<image>") and lines[2]["prompt"].startswith("<video>")
    assert lines[0]["media"][0].endswith(".png") and lines[2]["media"][0].endswith(".mp4")
    assert [r["text"] for r in lines] == ["r0", "r0", "r1", "r1"] and lines[2]["score"] == 0.5


def test_docs_speak_of_the_project_only():
    import re

    pattern = re.compile(r"\b(issues? \d+|sessions? \d+|helper engineer)\b|\.\./shared|DESIGN\.md", re.IGNORECASE)
    hits = [f"{path.name}:{n}" for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
