"""specdec-head-data: the target's own responses (EAGLE-3's training data) through the runtime.
Greedy answers are exactly target-only greedy decoding, multi-turn histories carry the target's
own earlier answers, an interrupted run resumes without duplicates, bad input is one line, and
specdec-train-head trains on the output."""
from __future__ import annotations

import json

import pytest

from helpers import RUNTIME_FORBIDDEN, assert_runs_without, make_chat_checkpoint, make_perturbed_copy

from specdec_rt.cli import head_data as hd
from specdec_rt.errors import GenerationInputError


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def chat_bundle(tmp_path_factory):
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("head_data")
    ckpt = make_chat_checkpoint(base / "ckpt", "chatml", seed=2)
    draft = make_perturbed_copy(ckpt, base / "draft", noise=0.003)  # accepts ~15%: rejections happen
    export_pair(ckpt, draft, base / "bundle", ExportOptions(progress=False))
    return {"ckpt": ckpt, "bundle": base / "bundle"}


def test_reads_the_common_layouts(tmp_path):
    f = _write(tmp_path / "p.jsonl", [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "b"}]},
        {"id": "sg1", "conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "x"}]},
        {"question_id": 81, "category": "writing", "turns": ["d", "e"]},
        {"prompt": "f"},
        "g",
    ])
    convs, _ = hd.read_conversations([f])
    assert [(c.id, c.turns, c.system) for c in convs] == [
        ("p.jsonl:1", ["a", "b"], "be brief"), ("sg1", ["c"], None), ("81", ["d", "e"], None),
        ("p.jsonl:4", ["f"], None), ("p.jsonl:5", ["g"], None)]


def test_reads_sharegpt_json_lists(tmp_path):
    f = tmp_path / "sharegpt.json"
    f.write_text(json.dumps([{"id": "a1", "conversations": [{"from": "human", "value": "q"},
                                                            {"from": "gpt", "value": "r"},
                                                            {"from": "human", "value": "q2"}]},
                             {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "x"}]}]))
    convs, _ = hd.read_conversations([f])
    assert [(c.id, c.turns, c.system) for c in convs] == [("a1", ["q", "q2"], None), ("sharegpt.json[1]", ["x"], "s")]
    f.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(GenerationInputError, match="must hold a list"):
        hd.read_conversations([f])
    f.write_text(json.dumps([{"conversations": [{"from": "human"}]}]))
    with pytest.raises(GenerationInputError, match=r"sharegpt.json\[0\]: conversations\[0\] needs"):
        hd.read_conversations([f])


@pytest.mark.parametrize("line, words", [
    ("{not json", "p.jsonl:1: not valid JSON"),
    (json.dumps({"text": "x"}), "needs \"messages\""),
    (json.dumps({"messages": [{"role": "tool", "content": "x"}]}), "role 'tool'"),
    (json.dumps({"turns": ["ok", "  "]}), "non-empty string"),
    (json.dumps({"messages": [{"role": "assistant", "content": "x"}]}), "at least one"),
    (json.dumps([1, 2]), "expected an object"),
])
def test_bad_records_name_file_and_line(tmp_path, line, words):
    (tmp_path / "p.jsonl").write_text(line + "\n")
    with pytest.raises(GenerationInputError, match=words.replace("(", r"\(")):
        hd.read_conversations([tmp_path / "p.jsonl"])


def test_duplicate_ids_empty_turns_and_missing_files(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"id": 1, "prompt": "a"}, {"id": "1", "prompt": "b"}, {"turns": [" "]},
                                      {"id": 1, "messages": [{"role": "user", "content": "c"}]}])
    with pytest.raises(GenerationInputError, match="p.jsonl:2: conversation id '1' appears twice"):
        hd.read_conversations([f])
    convs, left_out = hd.read_conversations([f], strict=False)  # a scraped dump: numbered, left out
    assert [(c.id, c.turns) for c in convs] == [("1", ["a"]), ("1#2", ["b"]), ("1#3", ["c"])] and left_out == 1
    with pytest.raises(GenerationInputError, match="does not exist"):
        hd.read_conversations([tmp_path / "nope.jsonl"])
    assert hd.main(["--bundle", "x", "--prompts", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == 1


def test_greedy_answers_are_the_targets_and_history_carries_them(chat_bundle, tmp_path):
    import specdec_rt

    prompts = _write(tmp_path / "p.jsonl", [
        {"id": "two", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello there"},
                                   {"role": "assistant", "content": "human answer"},
                                   {"role": "user", "content": "and then?"}]},
        {"id": "one", "prompt": "def f(x):"},
        {"id": "three", "turns": ["a b c", "d e", "f"]},
    ])
    out = tmp_path / "out.jsonl"
    assert hd.main(["--bundle", str(chat_bundle["bundle"]), "--prompts", str(prompts), "--out", str(out),
                    "--max-new-tokens", "12", "--batch-size", "2", "--drafter", "model", "-k", "3",
                    "--no-progress"]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["two", "one", "three"]
    two = recs[0]["messages"]
    assert [m["role"] for m in two] == ["system", "user", "assistant", "user", "assistant"]
    assert "human answer" not in json.dumps(two)  # regenerated, not copied
    assert [m["role"] for m in recs[2]["messages"]] == ["user", "assistant"] * 3
    gen = specdec_rt.load(chat_bundle["bundle"], threads=1)
    for rec in recs:
        msgs = rec["messages"]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            alone = gen.chat(msgs[:i], max_new_tokens=12, drafter=None, temperature=0.0)
            assert m["content"] == alone.text
    assert sum(r["new_tokens"] for r in recs) > 0
    assert all(set(r["finish_reasons"]) <= {"length", "eos", "stop"} for r in recs)


def test_turns_beyond_the_context_cut_the_conversation_short(chat_bundle, tmp_path, capsys):
    long = " ".join(["word"] * 400)  # far beyond the 256-position context
    prompts = _write(tmp_path / "p.jsonl", [{"id": "cut", "turns": ["hi", long, "never asked"]},
                                            {"id": "whole", "turns": ["yo"]}, {"id": "none", "turns": [long]}])
    out = tmp_path / "o.jsonl"
    assert hd.main(["--bundle", str(chat_bundle["bundle"]), "--prompts", str(prompts), "--out", str(out),
                    "--max-new-tokens", "6", "--no-progress"]) == 1  # "none" could not start
    err = capsys.readouterr().err
    assert "skipped none:" in err and "1 cut short" in err
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"cut", "whole"}
    assert [m["role"] for m in recs["cut"]["messages"]] == ["user", "assistant"]
    assert recs["cut"]["truncated"].startswith("after turn 1 of 3:") and "truncated" not in recs["whole"]


def test_resume_skips_what_is_written(chat_bundle, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": f"question {i}"} for i in range(5)])
    args = ["--bundle", str(chat_bundle["bundle"]), "--prompts", str(prompts), "--max-new-tokens", "6",
            "--batch-size", "2", "--chunk", "2", "--no-progress"]
    full = tmp_path / "full.jsonl"
    assert hd.main([*args, "--out", str(full)]) == 0
    part = tmp_path / "part.jsonl"
    assert hd.main([*args, "--out", str(part), "--limit", "3"]) == 0
    with part.open("a") as f:
        f.write('{"id": "p.jsonl:4", "mess')  # killed mid-line
    assert hd.main([*args, "--out", str(part)]) == 0
    assert part.read_text() == full.read_text()
    assert hd.main([*args, "--out", str(part)]) == 0  # nothing left to do
    assert part.read_text() == full.read_text()
    bad = _write(tmp_path / "other.jsonl", [{"unrelated": 1}, {"x": 2}])
    with pytest.raises(GenerationInputError, match="not a record of this tool"):
        hd.done_ids(bad)


def test_sampled_runs_repeat_with_their_seed(chat_bundle, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    outs = []
    for name, batch in (("a", "1"), ("b", "3"), ("c", "3")):
        out = tmp_path / f"{name}.jsonl"
        assert hd.main(["--bundle", str(chat_bundle["bundle"]), "--prompts", str(prompts), "--out", str(out),
                        "--max-new-tokens", "8", "--temperature", "0.9", "--seed", "5", "-k", "2",
                        "--batch-size", batch, "--no-progress"]) == 0
        outs.append(out.read_text())
    assert outs[0] == outs[1] == outs[2]  # fixed K: a row's draws do not depend on its batch
    other = tmp_path / "d.jsonl"
    hd.main(["--bundle", str(chat_bundle["bundle"]), "--prompts", str(prompts), "--out", str(other),
             "--max-new-tokens", "8", "--temperature", "0.9", "--seed", "6", "-k", "2", "--no-progress"])
    assert other.read_text() != outs[0]


def test_plain_targets_take_single_prompts(tiny_pair, tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": "abc"}, "def"])
    out = tmp_path / "o.jsonl"
    assert hd.main(["--bundle", str(tiny_pair["bundle"]), "--prompts", str(prompts), "--out", str(out),
                    "--max-new-tokens", "5", "--no-progress"]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs[0]["text"].startswith("abc") and recs[1]["text"].startswith("def")
    multi = _write(tmp_path / "m.jsonl", [{"turns": ["a", "b"]}])
    assert hd.main(["--bundle", str(tiny_pair["bundle"]), "--prompts", str(multi), "--out", str(tmp_path / "m"),
                    "--no-progress"]) == 1
    assert "need a bundle with a chat template" in capsys.readouterr().err


def test_bad_numbers_are_usage_errors(capsys):
    for flag, value in (("--batch-size", "0"), ("--max-new-tokens", "0"), ("--limit", "-1"), ("--chunk", "x"),
                        ("--num-draft-tokens", "65")):
        with pytest.raises(SystemExit) as exc:
            hd.parse_args(["--bundle", "b", "--prompts", "p", "--out", "o", flag, value])
        assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_the_output_trains_a_head(chat_bundle, tmp_path):
    pytest.importorskip("torch")
    from specdec_rt.export import eagle_train as et

    prompts = _write(tmp_path / "p.jsonl", [{"turns": [f"write {i}", "more"]} for i in range(4)])
    out = tmp_path / "responses.jsonl"
    assert hd.main(["--bundle", str(chat_bundle["bundle"]), "--prompts", str(prompts), "--out", str(out),
                    "--max-new-tokens", "16", "--no-progress"]) == 0
    rc = et.main(["--target", str(chat_bundle["ckpt"]), "--data", str(out), "--out", str(tmp_path / "head"),
                  "--steps", "2", "--seq-len", "32", "--batch", "1", "--feature-layers", "0,1,1",
                  "--intermediate-size", "32", "--no-progress"])
    assert rc == 0
    log = json.loads((tmp_path / "head" / "training_log.json").read_text())
    assert log["data"]["chat_records"] == 4 and len(log["steps"]) == 2


def test_runs_without_torch(tiny_pair, tmp_path):
    """The data is made where the bundle runs: a run loads neither torch nor specdec_rt.export."""
    prompts = _write(tmp_path / "p.jsonl", ["abc"])
    code = ("from specdec_rt.cli.head_data import main\n"
            f"assert main(['--bundle', {str(tiny_pair['bundle'])!r}, '--prompts', {str(prompts)!r}, "
            f"'--out', {str(tmp_path / 'o.jsonl')!r}, '--max-new-tokens', '3', '--no-progress']) == 0\n")
    assert_runs_without(code, **RUNTIME_FORBIDDEN)
