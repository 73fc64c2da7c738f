"""Dataset specs (datasource), row normalization (rows), prompt tokenization (prompts), sampling (sampler)."""

from __future__ import annotations

import json

import datasets
import datasets.config
import numpy as np
import pytest

from areno.data import hub
from areno.data.source import DatasetSpec, parse_dataset_spec
from areno.data.prompts import select, tokenize_prompts
from areno.data.rows import load_rows, normalize_rows
from areno.data.sampler import PromptSampler
from areno.errors import UserError

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A pen costs $2. How much are 500 pens?", "answer": "2 * 500 = 1000\n#### 1,000"},
    {"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"},
]


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE with a ChatML template, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([r["question"] for r in ROWS] * 5 + ["You are a helpful assistant."], trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    out.chat_template = CHAT_TEMPLATE
    return out


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    # Keep `datasets`' arrow cache out of the user's home.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- specs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("gsm8k:main", DatasetSpec("hub", "openai/gsm8k", "main", "train")),
        ("gsm8k:main:test", DatasetSpec("hub", "openai/gsm8k", "main", "test")),
        ("openai/gsm8k:main", DatasetSpec("hub", "openai/gsm8k", "main", "train")),
        ("owner/name", DatasetSpec("hub", "owner/name", None, "train")),
        ("owner/name::validation", DatasetSpec("hub", "owner/name", None, "validation")),
        ("squad", DatasetSpec("hub", "squad", None, "train")),
    ],
)
def test_hub_specs_parse_to_name_config_split(spec, expected):
    assert parse_dataset_spec(spec) == expected


def test_split_argument_is_default_and_spec_split_wins():
    assert parse_dataset_spec("gsm8k:main", split="test").split == "test"
    assert parse_dataset_spec("gsm8k:main:train", split="test").split == "train"


@pytest.mark.parametrize("spec", ["missing.jsonl", "./data/missing", "/nope/x.parquet", "a/b/c"])
def test_missing_local_path_is_a_user_error_naming_it(spec):
    with pytest.raises(UserError, match="not found: " + spec.split(":")[0]):
        parse_dataset_spec(spec)


def test_unsupported_file_type_and_config_on_a_file_are_user_errors(tmp_path):
    txt = tmp_path / "rows.txt"
    txt.write_text("hi")
    with pytest.raises(UserError, match=r"unsupported file type '\.txt'"):
        parse_dataset_spec(str(txt))
    f = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(UserError, match="takes no ':config'"):
        parse_dataset_spec(f"{f}:main")


def test_hub_spec_calls_load_dataset_with_name_config_split(monkeypatch):
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(hub, "hub_status", lambda *a: hub.HubStatus("found"))
    rs = load_rows("gsm8k:main:test")
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"})]
    assert [r["answer"] for r in rs.rows] == ["7", "1000", "42"]
    load_rows("someone/data", split="validation")
    assert calls[-1] == (("someone/data", None), {"split": "validation"})


def test_unreachable_hub_dataset_is_a_user_error_suggesting_a_local_path(monkeypatch):
    # The real datasets.load_dataset; offline mode makes it fail at once instead
    # of retrying the network for ~25 s.
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=r"could not fetch dataset 'openai/gsm8k', config 'main'.*"
                       r"HF_HUB_OFFLINE is set.*local \.jsonl") as e:
        load_rows("gsm8k:main")
    assert "\n" not in str(e.value)


# -- local formats ---------------------------------------------------------------


def _save(tmp_path, fmt):
    ds = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        return str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    if fmt == "json":  # one JSON array
        (tmp_path / "d.json").write_text(json.dumps(ROWS))
        return str(tmp_path / "d.json")
    if fmt == "parquet":
        ds.to_parquet(str(tmp_path / "d.parquet"))
        return str(tmp_path / "d.parquet")
    if fmt == "csv":
        ds.to_csv(str(tmp_path / "d.csv"), index=False)
        return str(tmp_path / "d.csv")
    if fmt == "save_to_disk":
        ds.save_to_disk(str(tmp_path / "disk"))
        return str(tmp_path / "disk")
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "save_to_disk"])
def test_every_local_format_loads_and_normalizes(tmp_path, fmt):
    rs = load_rows(_save(tmp_path, fmt))
    assert len(rs) == 3 and rs.num_raw == 3 and rs.skipped == 0
    assert [r["prompt"] for r in rs.rows] == [r["question"] for r in ROWS]
    assert [r["answer"] for r in rs.rows] == ["7", "1000", "42"]


def test_save_to_disk_datasetdict_picks_the_split(tmp_path):
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS), test=datasets.Dataset.from_list(ROWS[:1])
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_rows(str(tmp_path / "dd"))) == 3
    assert len(load_rows(str(tmp_path / "dd"), split="test")) == 1
    assert len(load_rows(f"{tmp_path / 'dd'}::test")) == 1
    with pytest.raises(UserError, match=r"no split 'validation'; it has \['test', 'train'\]"):
        load_rows(str(tmp_path / "dd"), split="validation")


def test_local_copy_of_a_hub_repo_loads_with_config_and_split(tmp_path):
    # The layout of the openai/gsm8k repo: <config>/<split>-*.parquet + README configs.
    repo = tmp_path / "gsm8k"
    (repo / "main").mkdir(parents=True)
    datasets.Dataset.from_list(ROWS).to_parquet(str(repo / "main" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(ROWS[:2]).to_parquet(str(repo / "main" / "test-00000-of-00001.parquet"))
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n"
    )
    assert parse_dataset_spec(f"{repo}:main:test") == DatasetSpec("dir", str(repo), "main", "test")
    assert len(load_rows(f"{repo}:main:test")) == 2
    assert len(load_rows(f"{repo}:main")) == 3


def test_unreadable_file_is_a_user_error_naming_it(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(UserError, match=f"could not load dataset {bad}"):
        load_rows(str(bad))


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_json_file_says_so(tmp_path, suffix, text):
    f = tmp_path / f"empty{suffix}"
    f.write_text(text if suffix.startswith(".json") else "")
    with pytest.raises(UserError, match=f"dataset {f}: the file is empty"):
        load_rows(str(f))


def test_empty_csv_is_a_user_error_naming_it(tmp_path):
    f = tmp_path / "empty.csv"
    f.write_text("prompt,answer\n")
    with pytest.raises(UserError, match=f"{f}"):
        load_rows(str(f))


def test_broken_json_line_names_file_and_line_and_can_be_skipped(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b", "answer": 3 4}\n[1, 2]\n{"prompt": "c"}\n')
    with pytest.raises(UserError, match=rf"dataset {f}: line 3: not valid JSON: Expecting ',' "
                       r"delimiter \(column 29\).*--skip-bad-rows") as e:
        load_rows(str(f))
    assert "\n" not in str(e.value)
    rs = load_rows(str(f), skip_bad_rows=True)
    assert [r["prompt"] for r in rs.rows] == ["a", "c"]
    assert rs.skipped == 2 and rs.num_raw == 4
    assert rs.skip_reasons == ["line 3: not valid JSON: Expecting ',' delimiter (column 29)",
                               "line 4: expected a JSON object of fields, got list"]


def test_broken_json_array_names_the_line(tmp_path):
    f = tmp_path / "d.json"
    f.write_text('[\n {"prompt": "a"},\n {"prompt": "b",}\n]\n')
    with pytest.raises(UserError, match=f"dataset {f}: line 3: not valid JSON"):
        load_rows(str(f))
    f.write_text('[{"prompt": "a"}, 7]')
    with pytest.raises(UserError, match=r"element 1 of the JSON array is not an object of fields \(got int\)"):
        load_rows(str(f))
    f.write_text("[]")
    with pytest.raises(UserError, match="no rows"):
        load_rows(str(f))
    f = tmp_path / "d.jsonl"
    f.write_text('[{"prompt": "a"}]\n')
    with pytest.raises(UserError, match="line 1: expected a JSON object of fields, got list"):
        load_rows(str(f))


def test_json_file_of_columns_and_one_object_per_line(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps({"prompt": ["a", "b"], "answer": ["1", "2"]}, indent=1))
    assert [r["answer"] for r in load_rows(str(f)).rows] == ["1", "2"]
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [r["prompt"] for r in load_rows(str(f)).rows] == ["a", "b"]
    f.write_text('{"prompt": "a"}')
    assert [r["prompt"] for r in load_rows(str(f)).rows] == ["a"]


def test_json_lines_rows_get_every_key_and_row_errors_name_the_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "id": 1}\n\n{"prompt": "b"}\n{"answer": "4"}\n')
    with pytest.raises(UserError, match=r"row 2: field 'prompt' must be a string.*NoneType "
                       r"\(line 4; fix the row"):
        load_rows(str(f))
    rs = load_rows(str(f), skip_bad_rows=True)
    assert rs.rows[1]["id"] is None and rs.skipped == 1
    assert rs.skip_reasons[0].endswith("(line 4)")


# -- normalization ---------------------------------------------------------------


def test_prompt_rows_are_kept_with_their_extra_fields():
    rs = normalize_rows(
        [{"prompt": "hi", "answer": 3, "solutions": ("a", "b"), "id": 9},
         {"prompt": [{"role": "user", "content": "yo"}]}],
        source="t",
    )
    assert rs.rows[0] == {"prompt": "hi", "answer": "3", "solutions": ["a", "b"], "id": 9}
    assert rs.rows[1]["answer"] is None and rs.rows[1]["solutions"] is None


@pytest.mark.parametrize(
    "row, culprit",
    [
        ({"text": "no prompt"}, "row 1: field 'prompt' missing"),
        ({"prompt": 5}, "row 1: field 'prompt' must be a string"),
        ({"prompt": [{"role": "user", "content": 1}]}, r"row 1: field 'prompt\[0\].content'"),
        ({"prompt": []}, "row 1: field 'prompt'"),
        ({"prompt": "q", "answer": ["x"]}, "row 1: field 'answer' must be a string"),
        ({"prompt": "q", "solutions": "x"}, "row 1: field 'solutions' must be a list of strings"),
    ],
)
def test_malformed_row_errors_name_the_row_and_field_or_are_skipped(row, culprit):
    raw = [{"prompt": "ok"}, row, {"prompt": "ok too"}]
    with pytest.raises(UserError, match=culprit) as e:
        normalize_rows(raw, source="d.jsonl")
    assert "d.jsonl" in str(e.value) and "--skip-bad-rows" in str(e.value)
    rs = normalize_rows(raw, source="d.jsonl", skip_bad_rows=True)
    assert len(rs) == 2 and rs.skipped == 1 and "row 1" in rs.skip_reasons[0]


def test_all_rows_bad_is_an_error_even_when_skipping():
    with pytest.raises(UserError, match="no usable rows.*2 malformed.*row 0"):
        normalize_rows([{"x": 1}, {"y": 2}], source="t", skip_bad_rows=True)


def test_malformed_row_in_a_file_names_the_row(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": None}])
    with pytest.raises(UserError, match=f"dataset {f}: row 2: field 'prompt'"):
        load_rows(str(f))
    assert load_rows(str(f), skip_bad_rows=True).skipped == 1


def test_loader_fn_default_name_custom_name_filtering_and_errors(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"q": "one", "a": 1}, {"q": "two", "a": 2}, {"q": "", "a": 3}])
    loader = tmp_path / "loader.py"
    loader.write_text(
        "def load_row(row):\n"
        "    if not row['q']:\n"
        "        return None\n"
        "    return {'prompt': 'Q: ' + row['q'], 'answer': str(row['a'])}\n"
        "def shout(row):\n"
        "    return {'prompt': row['q'].upper(), 'n': row['a']}\n"
        "def broken(row):\n"
        "    return {'prompt': row['missing']}\n"
    )
    rs = load_rows(str(f), loader_fn=str(loader))
    assert [r["prompt"] for r in rs.rows] == ["Q: one", "Q: two"] and rs.filtered == 1
    rs = load_rows(str(f), loader_fn=f"{loader}:shout")
    assert rs.rows[0] == {"prompt": "ONE", "n": 1, "answer": None, "solutions": None}
    with pytest.raises(UserError, match=r"row 0: loader_fn raised KeyError: 'missing' \(loader.py:8\)"):
        load_rows(str(f), loader_fn=f"{loader}:broken")
    with pytest.raises(UserError, match="defines no function 'nope'"):
        load_rows(str(f), loader_fn=f"{loader}:nope")
    with pytest.raises(UserError, match="not found: .*absent.py"):
        load_rows(str(f), loader_fn=str(tmp_path / "absent.py"))


# -- prompts -----------------------------------------------------------------------


def test_tokenize_prompts_renders_the_chat_template_and_stores_csr(tokenizer):
    rows = normalize_rows(ROWS, source="t").rows
    ps = tokenize_prompts(rows, tokenizer, system_prompt="You are a helpful assistant.", max_prompt_len=512)
    convs = [
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": r["prompt"]}]
        for r in rows
    ]
    texts = tokenizer.apply_chat_template(convs, tokenize=False, add_generation_prompt=True)
    assert ps.texts == texts and texts[0].endswith("<|im_start|>assistant\n")
    assert ps.ids.dtype == np.int32 and ps.offsets.dtype == np.int64 and ps.row_index.dtype == np.int64
    for p, text in enumerate(texts):
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ps.ids[ps.offsets[p] : ps.offsets[p + 1]].tolist() == expected
    assert ps.row_index.tolist() == [0, 1, 2] and len(ps) == 3


def test_system_prompt_is_not_added_over_an_existing_one(tokenizer):
    rows = [{"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]}]
    (text,) = tokenize_prompts(rows, tokenizer, system_prompt="other", max_prompt_len=512).texts
    assert "own" in text and "other" not in text


def test_overlong_and_empty_prompts_are_dropped_and_counted(tokenizer):
    rows = [{"prompt": "What is 6 times 7?"}, {"prompt": "apples " * 200}, {"prompt": ""}, {"prompt": "Tom"}]
    ps = tokenize_prompts(rows, tokenizer, use_chat_template=False, max_prompt_len=40)
    assert ps.row_index.tolist() == [0, 3]
    assert ps.dropped_overlong == 1 and ps.dropped_empty == 1
    assert ps.texts == ["What is 6 times 7?", "Tom"]
    assert ps.lengths.max() <= 40
    with pytest.raises(UserError, match=r"no prompt fits --max-prompt-len=3: 2 of 3 .*\(shortest (?:[4-9]|\d{2,}) tokens\), 1 are empty"):
        tokenize_prompts(rows[:3], tokenizer, use_chat_template=False, max_prompt_len=3)


def test_plain_text_mode_and_template_errors(tokenizer):
    (text,) = tokenize_prompts([{"prompt": "Q"}], tokenizer, use_chat_template=False, system_prompt="S",
                               max_prompt_len=10).texts
    assert text == "S\n\nQ"
    with pytest.raises(UserError, match="row 0: field 'prompt' is a list of chat messages"):
        tokenize_prompts([{"prompt": [{"role": "user", "content": "x"}]}], tokenizer, use_chat_template=False,
                         max_prompt_len=10)
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(UserError, match="no chat template.*--no-chat-template"):
        tokenize_prompts([{"prompt": "Q"}], bare, max_prompt_len=10)


def test_select_gathers_the_chosen_prompts_flat(tokenizer):
    rows = [{"prompt": "a" * k} for k in range(1, 8)]
    ps = tokenize_prompts(rows, tokenizer, use_chat_template=False, max_prompt_len=100)
    idx = np.array([5, 0, 5, 3], dtype=np.int64)
    ids, offsets = select(ps, idx)
    expected = [ps.ids[ps.offsets[i] : ps.offsets[i + 1]] for i in idx]
    assert ids.dtype == np.int32 and offsets.dtype == np.int64
    assert offsets.tolist() == np.cumsum([0] + [len(e) for e in expected]).tolist()
    np.testing.assert_array_equal(ids, np.concatenate(expected))
    ids, offsets = select(ps, np.zeros(0, np.int64))
    assert ids.size == 0 and offsets.tolist() == [0]


# -- sampler ---------------------------------------------------------------------------


def test_sampler_is_deterministic_and_each_epoch_is_a_shuffle_without_repeats():
    a, b = PromptSampler(10, 3, seed=7), PromptSampler(10, 3, seed=7)
    batches = [a.next_batch() for _ in range(9)]
    assert all(np.array_equal(x, b.next_batch()) for x in batches)
    assert all(x.dtype == np.int64 and x.shape == (3,) for x in batches)
    for e in range(3):  # 3 batches per epoch, the last 10 % 3 = 1 prompt dropped
        epoch = np.concatenate(batches[3 * e : 3 * e + 3])
        assert len(set(epoch.tolist())) == 9
    assert not np.array_equal(np.concatenate(batches[:3]), np.concatenate(batches[3:6]))
    assert a.epoch == 2 and a.position == 9
    assert not np.array_equal(PromptSampler(10, 3, seed=8).next_batch(), batches[0])


def test_sampler_resumes_the_same_order_from_its_state():
    a = PromptSampler(50, 8, seed=1)
    for _ in range(11):  # into the 2nd epoch
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # as a checkpoint would store it
    rest = [a.next_batch() for _ in range(10)]
    b = PromptSampler(50, 8, seed=123)
    b.load_state_dict(state)
    assert all(np.array_equal(x, b.next_batch()) for x in rest)


def test_sampler_rejects_impossible_batch_and_foreign_state():
    with pytest.raises(UserError, match="batch size 11 is larger than the dataset's 10"):
        PromptSampler(10, 11, seed=0)
    with pytest.raises(UserError, match="resume: the dataset now has 10 usable prompts.*12"):
        PromptSampler(10, 2, seed=0).load_state_dict(PromptSampler(12, 2, seed=0).state_dict())


def test_cli_reports_a_broken_line_in_one_line_with_exit_2(tmp_path, capsys, tiny_arith_path):
    """Through `areno train`, before any rank is built (tests/test_startup.py: the
    processes started early to overlap start-up are stopped)."""
    from areno.cli import main

    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4,}\n')
    rc = main(["train", "--ckpt", str(tiny_arith_path), "--dataset-path", str(f), "--reward-fn-path",
               "builtin:arith", "--no-chat-template", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"dataset {f}: line 2: not valid JSON" in err[0]


def test_a_mistake_in_the_eval_set_names_its_own_flag(tmp_path, capsys, monkeypatch, areno_cache, tiny_arith_path):
    """--eval-dataset-path goes through the same loader as --dataset-path; its
    mistakes name --eval-dataset-path (they once said --dataset-path). The demo
    model is built first (tiny_arith_path), so the run writes nothing else."""
    from helpers import refused

    with pytest.raises(UserError, match="--eval-dataset-path: file not found: /nope/eval.jsonl"):
        load_rows("/nope/eval.jsonl", flag="--eval-dataset-path")
    monkeypatch.setenv("ARENO_CACHE", str(areno_cache))
    line = refused(["--eval-dataset-path", "/nope/eval.jsonl", "--reward-fn-path", "builtin:arith",
                    "--output-dir", str(tmp_path / "run")], capsys)
    assert "--eval-dataset-path: file not found: /nope/eval.jsonl" in line, line
