"""PromptDataset (bad rows skipped, counted, warned; bad files rejected) and the resumable PromptLoader."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rollplex_train.config import DataConfig
from rollplex_train.data.dataset import PromptDataset, load_table
from rollplex_train.data.loader import PromptLoader
from rollplex_train.data.synthetic import MANIFEST_SCHEMA, VisualTaskSpec, generate_visual_tasks

NUM_TRAIN = 8  # per task


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tasks")
    generate_visual_tasks(out, VisualTaskSpec(num_train=NUM_TRAIN, num_val=2, seed=5))
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from rollplex_train.models.tiny import build_tokenizer

    return build_tokenizer()


def _cfg(files: str, **kw) -> DataConfig:
    return DataConfig(train_files=files, **kw)


def _good_row(tasks_dir: Path, task: str = "color") -> dict:
    return pq.read_table(tasks_dir / f"{task}_train.parquet").to_pylist()[0]


def _write_rows(path: Path, rows: list[dict], schema: pa.Schema = MANIFEST_SCHEMA) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def test_valid_samples(tasks_dir: Path, tokenizer):
    files = str(tasks_dir / "train.parquet")
    ds = PromptDataset(_cfg(files), tokenizer, files, "train")
    assert len(ds) == 3 * NUM_TRAIN
    image_pad, video_pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
    rows = pq.read_table(tasks_dir / "train.parquet").to_pylist()
    for i in range(len(ds)):
        sample = ds.get(i)
        assert sample is not None and sample.uid == f"train:{i}"
        assert (sample.task, sample.ground_truth, sample.options) == (rows[i]["task"], rows[i]["answer"],
                                                                      rows[i]["options"])
        vision = sample.vision
        assert vision.num_images == len(rows[i]["images"]) and vision.num_videos == len(rows[i]["videos"])
        if vision.num_images:
            assert int((sample.prompt_ids == image_pad).sum()) == int(vision.image_grid_thw.prod()) // 4
            assert vision.pixel_values.shape == (int(vision.image_grid_thw.prod()), 1176)
        if vision.num_videos:
            # 8 frames at 4 fps sampled at 2 fps: 4 frames -> t = 2, 1 s per temporal step.
            assert vision.video_grid_thw.tolist() == [[2, 4, 4]]
            assert vision.second_per_grid_ts.tolist() == [1.0]
            assert int((sample.prompt_ids == video_pad).sum()) == 8
    assert not ds.skipped


def _assert_skipped(ds: PromptDataset, index: int, reason: str, caplog, file_name: str, row: int) -> None:
    """Row ``index`` is skipped and counted once; only the first row of each reason is logged."""
    before = ds.skipped[reason]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollplex_train.data.dataset"):
        assert ds.get(index) is None
        assert ds.get(index) is None  # second look: neither counted nor logged again
    assert ds.skipped[reason] == before + 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if before:
        assert warnings == []  # a later row of a reason already reported: counted, not logged
    else:
        assert len(warnings) == 1 and file_name in warnings[0] and f"row {row}" in warnings[0] and reason in warnings[0]
        assert "not logged" in warnings[0]


def test_bad_rows_skipped_counted_warned(tasks_dir: Path, tokenizer, caplog):
    good = _good_row(tasks_dir)
    (tasks_dir / "media" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    (tasks_dir / "media" / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 truncated")
    rows = [
        good,
        {**good, "images": ["media/does_not_exist.png"]},
        {**good, "images": ["media/broken.png"]},
        {**good, "answer": None},
        {**good, "problem": "What is the colour of the shape?"},  # no <image> but one image
        {**good, "problem": "<image>" + " Describe the shape in many many words." * 80},
        {**_good_row(tasks_dir, "direction"), "videos": ["media/broken.mp4"]},
    ]
    files = _write_rows(tasks_dir / "bad.parquet", rows)
    ds = PromptDataset(_cfg(files, max_prompt_length=200), tokenizer, files, "train")
    assert ds.get(0) is not None
    expected = {1: "missing_media", 2: "corrupt_media", 3: "bad_schema", 4: "placeholder_mismatch",
                5: "too_long", 6: "corrupt_media"}
    for index, reason in expected.items():
        _assert_skipped(ds, index, reason, caplog, "bad.parquet", index)
    assert ds.skipped == {"missing_media": 1, "corrupt_media": 2, "bad_schema": 1, "placeholder_mismatch": 1,
                          "too_long": 1}


def test_empty_problem_is_empty_prompt(tasks_dir: Path, tokenizer, caplog):
    """An empty problem with one image is not a placeholder mismatch: the prompt is missing."""
    good = _good_row(tasks_dir)
    files = _write_rows(tasks_dir / "empty_problem.parquet", [good, {**good, "problem": ""},
                                                              {**good, "problem": "  \n", "images": []}])
    ds = PromptDataset(_cfg(files), tokenizer, files, "train")
    _assert_skipped(ds, 1, "empty_prompt", caplog, "empty_problem.parquet", 1)
    _assert_skipped(ds, 2, "empty_prompt", caplog, "empty_problem.parquet", 2)
    assert ds.skipped == {"empty_prompt": 2} and ds.get(0) is not None


def test_jsonl_answers_arrive_byte_exact(tasks_dir: Path, tokenizer, caplog):
    """One JSON-number answer must not retype the column: every string answer arrives as written,
    the number becomes its JSON text and is counted as coerced_answer."""
    good = _good_row(tasks_dir)
    answers = [30, "1.50", "007", "1e3", "true", "null", "[1, 2]", "  spaced  ", "\u00e9t\u00e9", [3, 4]]
    path = tasks_dir / "answers.jsonl"
    lines = [json.dumps({"problem": good["problem"], "answer": a, "images": good["images"]}) for a in answers]
    path.write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")  # a blank line is ignored
    ds = PromptDataset(_cfg(str(path)), tokenizer, str(path), "train")
    assert len(ds) == len(answers)
    with caplog.at_level(logging.WARNING, logger="rollplex_train.data.dataset"):
        truths = [ds.get(i).ground_truth for i in range(len(ds))]
        ds.get(0)  # a second look counts nothing again
    assert truths == ["30", "1.50", "007", "1e3", "true", "null", "[1, 2]", "  spaced  ", "\u00e9t\u00e9", "[3, 4]"]
    assert ds.coerced == {"coerced_answer": 2} and not ds.skipped
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "answers.jsonl row 0" in warnings[0] and "coerced_answer" in warnings[0]


def test_jsonl_bad_lines_are_skipped_and_counted(tasks_dir: Path, tokenizer, caplog):
    good = _good_row(tasks_dir)
    row = json.dumps({"problem": good["problem"], "answer": "red", "images": good["images"]})
    path = tasks_dir / "bad_lines.jsonl"
    path.write_text("\n".join([row, "{not json", "[1, 2]", json.dumps({**json.loads(row), "answer": None})]))
    ds = PromptDataset(_cfg(str(path)), tokenizer, str(path), "train")
    assert ds.get(0).ground_truth == "red"
    for index in (1, 2, 3):
        _assert_skipped(ds, index, "bad_schema", caplog, "bad_lines.jsonl", index)


def test_images_not_a_list_is_bad_schema(tasks_dir: Path, tokenizer, caplog):
    good = _good_row(tasks_dir)
    path = tasks_dir / "strings.jsonl"
    path.write_text(json.dumps({"problem": good["problem"], "answer": "red", "images": good["images"][0]}) + "\n")
    ds = PromptDataset(_cfg(str(path)), tokenizer, str(path), "train")
    _assert_skipped(ds, 0, "bad_schema", caplog, "strings.jsonl", 0)


def test_hf_image_feature_rows(tasks_dir: Path, tokenizer, caplog):
    """geometry3k-style manifests: images stored as HF Image structs (bytes) are read without decoding."""
    import datasets

    good = _good_row(tasks_dir)
    png = (tasks_dir / good["images"][0]).read_bytes()
    table = datasets.Dataset.from_dict({
        "problem": [good["problem"]] * 2,
        "answer": ["red", "blue"],
        "images": [[{"bytes": png, "path": None}], [{"bytes": b"garbage", "path": "x.png"}]],
    }).cast_column("images", datasets.List(datasets.Image()))
    path = tasks_dir / "hf_images.parquet"
    table.to_parquet(str(path))
    ds = PromptDataset(_cfg(str(path)), tokenizer, str(path), "train")
    sample = ds.get(0)
    assert sample is not None and sample.vision.image_grid_thw.tolist() == [[1, 4, 4]]
    assert sample.options == [] and sample.task == "default"
    _assert_skipped(ds, 1, "corrupt_media", caplog, "hf_images.parquet", 1)


def test_exif_rotated_jpeg_same_pixels_on_jsonl_and_parquet(tasks_dir: Path, tokenizer):
    """A phone JPEG (stored 320x240, EXIF Orientation 6) reaches the model upright from a jsonl path
    and from parquet bytes alike: a 240x320 picture is a grid taller than wide."""
    import datasets

    from test_data_vision import exif_rotated_jpeg

    data = exif_rotated_jpeg()
    (tasks_dir / "media" / "phone.jpg").write_bytes(data)
    problem = "<image>What colour is the top half?"
    jsonl = tasks_dir / "phone.jsonl"
    jsonl.write_text(json.dumps({"problem": problem, "answer": "red", "images": ["media/phone.jpg"]}) + "\n")
    parquet = tasks_dir / "phone.parquet"
    datasets.Dataset.from_dict({"problem": [problem], "answer": ["red"], "images": [[{"bytes": data, "path": None}]]}
                               ).cast_column("images", datasets.List(datasets.Image())).to_parquet(str(parquet))
    cfg = _cfg(str(jsonl), max_pixels=240 * 320)
    by_path = PromptDataset(cfg, tokenizer, str(jsonl), "train").get(0)
    by_bytes = PromptDataset(cfg, tokenizer, str(parquet), "train").get(0)
    grid = by_path.vision.image_grid_thw.tolist()
    assert grid == by_bytes.vision.image_grid_thw.tolist() == [[1, 22, 16]]  # smart_resize(320, 240): 308x224
    assert torch.equal(by_path.vision.pixel_values, by_bytes.vision.pixel_values)


def test_file_level_errors(tasks_dir: Path, tokenizer):
    with pytest.raises(FileNotFoundError, match="nowhere.parquet"):
        load_table(f"{tasks_dir / 'train.parquet'},{tasks_dir / 'nowhere.parquet'}")
    with pytest.raises(ValueError, match="unknown data file extension"):
        load_table(str(tasks_dir / "train.csv"))
    empty = _write_rows(tasks_dir / "empty.parquet", [])
    with pytest.raises(ValueError, match="empty.parquet.*empty"):
        PromptDataset(_cfg(empty), tokenizer, empty, "train")
    (tasks_dir / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl"):
        load_table(str(tasks_dir / "empty.jsonl"))
    schema = pa.schema([f for f in MANIFEST_SCHEMA if f.name != "answer"])
    row = {k: v for k, v in _good_row(tasks_dir).items() if k != "answer"}
    no_answer = _write_rows(tasks_dir / "no_answer.parquet", [row], schema)
    with pytest.raises(ValueError, match="no_answer.parquet.*'answer'"):
        PromptDataset(_cfg(no_answer), tokenizer, no_answer, "train")
    files = str(tasks_dir / "train.parquet")
    with pytest.raises(ValueError, match="'question'.*data.prompt_key"):
        PromptDataset(_cfg(files, prompt_key="question"), tokenizer, files, "train")
    with pytest.raises(FileNotFoundError, match="format_prompt"):
        PromptDataset(_cfg(files, format_prompt=str(tasks_dir / "no.jinja")), tokenizer, files, "train")


def test_load_table_concatenates(tasks_dir: Path):
    table = load_table(f"{tasks_dir / 'color_train.parquet'}, {tasks_dir / 'count_train.parquet'}")
    assert len(table) == 2 * NUM_TRAIN
    assert table[NUM_TRAIN]["task"] == "count"


def test_format_prompt_file_and_system_prompt(tasks_dir: Path, tokenizer):
    template = tasks_dir / "r1v.jinja"
    template.write_text("{{ content | trim }} Put the final answer in \\boxed{}.\n")
    files = str(tasks_dir / "color_val.parquet")
    cfg = _cfg(files, format_prompt=str(template), system_prompt="Answer briefly.")
    sample = PromptDataset(cfg, tokenizer, files, "val").get(0)
    text = tokenizer.decode(sample.prompt_ids)
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")
    assert "yellow. Put the final answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n" in text


def _uids(batch) -> list[str]:
    return [s.uid for s in batch]


def test_loader_deterministic_and_resumable(tasks_dir: Path, tokenizer):
    files = str(tasks_dir / "train.parquet")
    ds = PromptDataset(_cfg(files), tokenizer, files, "train")
    loader = PromptLoader(ds, batch_size=5, shuffle=True, seed=7)
    first = [_uids(loader.next_batch()[0]) for _ in range(3)]
    state = loader.state_dict()
    after = [_uids(loader.next_batch()[0]) for _ in range(4)]  # crosses into epoch 1 (24 rows, 4 batches/epoch)
    assert loader.epoch == 1
    again = PromptLoader(ds, batch_size=5, shuffle=True, seed=7)
    assert [_uids(again.next_batch()[0]) for _ in range(3)] == first
    resumed = PromptLoader(ds, batch_size=5, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    assert [_uids(resumed.next_batch()[0]) for _ in range(4)] == after
    epoch0 = sum(first, []) + after[0]
    assert len(set(epoch0)) == 20  # no repeats within an epoch
    assert epoch0 != sorted(epoch0, key=lambda u: int(u.split(":")[1]))  # shuffled
    assert after[1] != first[0]  # a new permutation each epoch
    other = PromptLoader(ds, batch_size=5, shuffle=True, seed=8)
    assert _uids(other.next_batch()[0]) != first[0]


def test_resume_on_changed_data_refused_or_restarts_epoch(tasks_dir: Path, tokenizer, caplog):
    """A 6-of-8 position must not be applied to a 5-row file (it would silently roll into epoch 1)."""
    rows = pq.read_table(tasks_dir / "color_train.parquet").to_pylist()
    eight = _write_rows(tasks_dir / "eight.parquet", rows[:8])
    five = _write_rows(tasks_dir / "five.parquet", rows[:5])
    saved = PromptLoader(PromptDataset(_cfg(eight), tokenizer, eight, "train"), batch_size=2, shuffle=False, seed=0)
    for _ in range(3):
        saved.next_batch()
    state = saved.state_dict()
    assert (state["epoch"], state["position"]) == (0, 6) and len(state["data_fingerprint"]) == 64

    same = PromptLoader(PromptDataset(_cfg(eight), tokenizer, eight, "train"), batch_size=2, shuffle=False, seed=0)
    same.load_state_dict(state)
    assert _uids(same.next_batch()[0]) == ["train:6", "train:7"]

    other = PromptLoader(PromptDataset(_cfg(five), tokenizer, five, "train"), batch_size=2, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="five.parquet.*data.resume_on_changed_data=true"):
        other.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="rollplex_train.data.loader"):
        other.load_state_dict(state, resume_on_changed_data=True)
    assert "restarts" in caplog.text
    assert (other.epoch, other.position) == (0, 0)
    assert _uids(other.next_batch()[0]) == ["train:0", "train:1"]  # epoch 0 from its start

    moved = tasks_dir / "moved"
    moved.mkdir(exist_ok=True)
    copy = moved / "renamed.parquet"
    copy.write_bytes(Path(eight).read_bytes())  # same bytes elsewhere: the same data
    again = PromptLoader(PromptDataset(_cfg(str(copy)), tokenizer, str(copy), "train"), batch_size=2, shuffle=False,
                         seed=0)
    again.load_state_dict(state)
    assert again.position == 6


def test_trainer_refuses_resume_on_changed_data_before_ray(tasks_dir: Path, tiny_ckpt_qwen25, tmp_path):
    from rollplex_train.config import Config, ModelConfig, TrainerConfig
    from rollplex_train.tracking.checkpoint import save_json
    from rollplex_train.trainer import Trainer

    rows = pq.read_table(tasks_dir / "color_train.parquet").to_pylist()
    eight = _write_rows(tasks_dir / "eight_t.parquet", rows[:8])
    five = _write_rows(tasks_dir / "five_t.parquet", rows[:5])

    def config(files: str, resume: str = str(tmp_path / "ckpt"), **data) -> Config:
        return Config(model=ModelConfig(path=str(tiny_ckpt_qwen25)),
                      data=DataConfig(train_files=files, val_files="", rollout_batch_size=2, shuffle=False, **data),
                      trainer=TrainerConfig(output_dir=str(tmp_path / "run"), resume=resume, loggers=["jsonl"]))

    first = Trainer(config(eight, resume="disable"), tmp_path / "run")
    for _ in range(3):
        first.loader.next_batch()
    (tmp_path / "ckpt").mkdir()
    save_json({"step": 3, "loader": first.loader.state_dict()}, tmp_path / "ckpt" / "trainer_state.json")
    with pytest.raises(ValueError, match="data.resume_on_changed_data"):
        Trainer(config(five), tmp_path / "run")
    Trainer(config(five, resume_on_changed_data=True), tmp_path / "run")  # accepted; the epoch restarts at resume
    Trainer(config(eight), tmp_path / "run")  # the same data resumes


def _tasks_of(ds: PromptDataset, batch) -> list[str]:
    return [ds.row_tasks()[int(s.uid.split(":")[1])] for s in batch]


def test_loader_curriculum_stages_then_every_row(tasks_dir: Path, tokenizer, caplog):
    """Stage rows only, in epochs of their own; then the plain epochs; resumable mid-stage."""
    from rollplex_train.config import CurriculumStage

    files = str(tasks_dir / "train.parquet")  # 8 rows per task, interleaved color, count, direction
    ds = PromptDataset(_cfg(files), tokenizer, files, "train")
    assert list(ds.row_tasks()[:3]) == ["color", "count", "direction"] and len(ds.row_tasks()) == 24
    stages = [CurriculumStage(steps=5, tasks=["direction"]), CurriculumStage(steps=2, tasks=["color", "count"])]
    loader = PromptLoader(ds, batch_size=3, shuffle=True, seed=7, curriculum=stages)
    with caplog.at_level(logging.INFO, logger="rollplex_train.data.loader"):
        batches = [loader.next_batch()[0] for _ in range(9)]
    tasks = [_tasks_of(ds, b) for b in batches]
    assert all(t == ["direction"] * 3 for t in tasks[:5])
    first_epoch = sum((_uids(b) for b in batches[:2]), [])
    assert len(set(first_epoch)) == 6  # no repeats inside a stage's epoch (8 direction rows: 2 batches)
    assert all(set(t) <= {"color", "count"} for t in tasks[5:7])
    assert "data.curriculum[1]: 2 steps of tasks ['color', 'count']" in caplog.text
    assert "data.curriculum done" in caplog.text
    plain = PromptLoader(ds, batch_size=3, shuffle=True, seed=7)
    assert [_uids(b) for b in batches[7:9]] == [_uids(plain.next_batch()[0]) for _ in range(2)]  # epoch 0 of all rows

    again = PromptLoader(ds, batch_size=3, shuffle=True, seed=7, curriculum=stages)
    for _ in range(3):
        again.next_batch()
    state = again.state_dict()
    assert (state["stage"], state["batches_in_stage"]) == (0, 3)
    resumed = PromptLoader(ds, batch_size=3, shuffle=True, seed=7, curriculum=stages)
    resumed.load_state_dict(state)
    assert [_uids(resumed.next_batch()[0]) for _ in range(6)] == [_uids(b) for b in batches[3:9]]

    with pytest.raises(ValueError, match=r"data.curriculum=\[\[5, \['direction'\]\].*has \[\]"):
        PromptLoader(ds, batch_size=3, shuffle=True, seed=7).load_state_dict(state)


def test_loader_curriculum_bad_stage_refused(tasks_dir: Path, tokenizer):
    from rollplex_train.config import CurriculumStage

    files = str(tasks_dir / "train.parquet")
    ds = PromptDataset(_cfg(files), tokenizer, files, "train")
    with pytest.raises(ValueError, match=r"data.curriculum\[0\].tasks=\['motion'\]: no train row has task 'motion'; "
                                         r"the tasks in data.train_files are \['color', 'count', 'direction'\]"):
        PromptLoader(ds, batch_size=3, shuffle=True, seed=0, curriculum=[CurriculumStage(steps=1, tasks=["motion"])])
    with pytest.raises(ValueError, match=r"data.curriculum\[0\].tasks=\['color'\]: 8 train rows, fewer than "
                                         r"data.rollout_batch_size=9"):
        PromptLoader(ds, batch_size=9, shuffle=True, seed=0, curriculum=[CurriculumStage(steps=1, tasks=["color"])])
    with pytest.raises(ValueError, match=r"data.curriculum\[0\]: expected steps > 0"):
        DataConfig(curriculum=[CurriculumStage(steps=0, tasks=["color"])])


def test_loader_skips_bad_rows(tasks_dir: Path, tokenizer):
    good = _good_row(tasks_dir)
    rows = [good, {**good, "images": ["media/gone.png"]}, good, {**good, "answer": None}, good]
    files = _write_rows(tasks_dir / "some_bad.parquet", rows)
    ds = PromptDataset(_cfg(files), tokenizer, files, "train")
    loader = PromptLoader(ds, batch_size=3, shuffle=False, seed=0)
    batch, num_skipped = loader.next_batch()
    assert _uids(batch) == ["train:0", "train:2", "train:4"] and num_skipped == 2
    batch, num_skipped = loader.next_batch()  # epoch 1: the known-bad rows are skipped again
    assert len(batch) == 3 and num_skipped == 2
    assert ds.skipped == {"missing_media": 1, "bad_schema": 1}
    short = PromptLoader(ds, batch_size=2, shuffle=False, seed=0, drop_last=False)
    assert [len(short.next_batch()[0]) for _ in range(3)] == [2, 1, 2]


def test_loader_epoch_without_a_batch_raises(tasks_dir: Path, tokenizer):
    good = _good_row(tasks_dir)
    files = _write_rows(tasks_dir / "all_bad.parquet", [{**good, "images": ["media/x.png"]}] * 3)
    ds = PromptDataset(_cfg(files), tokenizer, files, "train")
    with pytest.raises(ValueError, match="0 of 3 rows are valid"):
        PromptLoader(ds, batch_size=2, shuffle=True, seed=0).next_batch()
    files = _write_rows(tasks_dir / "too_few.parquet", [good, good])
    ds = PromptDataset(_cfg(files), tokenizer, files, "train")
    with pytest.raises(ValueError, match="no batch of 3"):
        PromptLoader(ds, batch_size=3, shuffle=True, seed=0).next_batch()


def test_iter_all_in_order(tasks_dir: Path, tokenizer):
    files = str(tasks_dir / "val.parquet")
    ds = PromptDataset(_cfg(files), tokenizer, files, "val")
    loader = PromptLoader(ds, batch_size=4, shuffle=True, seed=0)
    batches = list(loader.iter_all(4))
    assert [len(b) for b in batches] == [4, 2]
    assert _uids(sum(batches, [])) == [f"val:{i}" for i in range(6)]
    assert [len(b) for b in ds.iter_all(4, max_samples=5)] == [4, 1]
    assert all(isinstance(s.prompt_ids, torch.Tensor) for b in batches for s in b)
