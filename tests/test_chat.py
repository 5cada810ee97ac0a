"""Chat templates (rendered without transformers, compared with transformers) and chat generation."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from chat_templates import CHATML, MISC
from helpers import RUNTIME_FORBIDDEN, assert_runs_without, make_chat_checkpoint, make_chat_tokenizer
from specdec_rt.errors import BundleError, ChatTemplateError
from specdec_rt.runtime.api.chat import ChatTemplate
from specdec_rt.runtime.core.tokenizer import TextTokenizer

MULTI_TURN = [
    {"role": "user", "content": "Write a function that adds two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
    {"role": "user", "content": "  Now make it subtract. Ünïcödé ✓ <b>  "},
]
WITH_SYSTEM = [{"role": "system", "content": "You are terse."}] + MULTI_TURN


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """style -> tokenizer folder (chatml_file: the ChatML template in chat_template.jinja)."""
    base = tmp_path_factory.mktemp("chat_tok")
    out = {s: make_chat_tokenizer(base / s, s) for s in ("chatml", "llama3", "gemma", "named")}
    out["chatml_file"] = make_chat_tokenizer(base / "chatml_file", "chatml", template_file=True)
    return out


def _hf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _ours(path):
    from specdec_rt.export.pipeline import chat_assets

    template, special = chat_assets(path)
    return ChatTemplate(template, special)


CASES = [
    ("chatml", MULTI_TURN), ("chatml", WITH_SYSTEM), ("chatml_file", WITH_SYSTEM),
    ("llama3", MULTI_TURN), ("llama3", WITH_SYSTEM), ("gemma", MULTI_TURN), ("named", WITH_SYSTEM),
    ("chatml", MULTI_TURN[:1]), ("gemma", MULTI_TURN[:2]),
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("style, messages", CASES)
def test_rendering_and_ids_equal_transformers(tokenizers, style, messages, add_generation_prompt):
    hf = _hf(tokenizers[style])
    ours = _ours(tokenizers[style])
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.render(messages, add_generation_prompt=add_generation_prompt)
    assert got == want
    want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                      return_dict=False)
    got_ids = TextTokenizer(tokenizers[style] / "tokenizer.json").encode(got, add_special_tokens=False)
    assert got_ids == want_ids


@pytest.mark.parametrize("style, bos", [("llama3", "<|begin_of_text|>"), ("gemma", "<bos>")])
def test_template_bos_is_not_doubled(tokenizers, style, bos):
    tok = TextTokenizer(tokenizers[style] / "tokenizer.json")
    bos_id = tok.tok.token_to_id(bos)
    assert tok.encode("hello")[0] == bos_id  # the post-processor adds BOS to plain prompts...
    ids = tok.encode(_ours(tokenizers[style]).render(MULTI_TURN), add_special_tokens=False)
    assert ids[0] == bos_id and ids.count(bos_id) == 1  # ...but a template's BOS is the only one


def test_file_fallback_reads_what_transformers_loads(tokenizers):
    from specdec_rt.export.pipeline import chat_assets, read_chat_files

    for style in ("chatml", "chatml_file", "llama3", "gemma", "named"):
        assert read_chat_files(tokenizers[style]) == chat_assets(tokenizers[style]), style


def test_gemma_template_refuses_system_role(tokenizers):
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="System role not supported"):
        _hf(tokenizers["gemma"]).apply_chat_template(WITH_SYSTEM, tokenize=False)
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        _ours(tokenizers["gemma"]).render(WITH_SYSTEM)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        _ours(tokenizers["gemma"]).render([MULTI_TURN[0], MULTI_TURN[0]])


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo <now>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("kwargs", [
    dict(),                                            # "default"
    dict(tools=TOOLS),                                 # "tool_use" is picked when tools are given
    dict(chat_template="tool_use"),                    # by name
    dict(chat_template="misc"),                        # namespace, loop controls, dict, tojson, generation tag
    dict(chat_template="misc", enable_thinking=False),  # extra template variables
    dict(chat_template=MISC.replace("<assistant>", "<bot>")),  # a template string
])
def test_named_templates_equal_transformers(tokenizers, kwargs):
    hf, ours = _hf(tokenizers["named"]), _ours(tokenizers["named"])
    messages = WITH_SYSTEM + [{"role": "skip", "content": "x"}, {"role": "stop", "content": "y"},
                              {"role": "user", "content": "after the stop"}]
    for agp in (True, False):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp, **kwargs)
        assert ours.render(messages, add_generation_prompt=agp, **kwargs) == want


def test_tools_and_tool_calls_equal_transformers(tokenizers):
    messages = MULTI_TURN + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "user", "content": "thanks"}]
    hf, ours = _hf(tokenizers["chatml"]), _ours(tokenizers["chatml"])
    want = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.render(messages, tools=TOOLS) == want
    assert '"description": "Météo <now>"' in want  # tojson: no ASCII or HTML escaping


def test_several_templates_without_default():
    ct = ChatTemplate({"a": CHATML, "b": CHATML})
    with pytest.raises(ChatTemplateError, match="none is named 'default'"):
        ct.render(MULTI_TURN)
    assert ct.render(MULTI_TURN, chat_template="b").startswith("<|im_start|>system")


@pytest.mark.parametrize("messages, word", [
    ("hello", "list"),
    ([], "empty"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
    ([{"role": "user", "content": 3}], "must be a string"),
    ([{"role": "user", "content": "hi", "extra": object()}], "cannot be passed"),
])
def test_bad_messages(messages, word):
    with pytest.raises(ChatTemplateError, match=word):
        ChatTemplate(CHATML).render(messages)


def test_template_sandbox():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="refused"):
        ChatTemplate(evil).render(MULTI_TURN)
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(MULTI_TURN)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}").render(MULTI_TURN)


# -- bundles ----------------------------------------------------------------------------------------

GREEDY_CONFIG = {"bos_token_id": None, "do_sample": False, "temperature": 0.7, "top_k": 5}
SAMPLING_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}


def _ids(tok_dir, *names):
    tok = TextTokenizer(tok_dir / "tokenizer.json").tok
    return [tok.token_to_id(n) for n in names]


@pytest.fixture(scope="module")
def chat_bundles(tmp_path_factory):
    """chatml: greedy config with two EOS ids; llama3: sampling config (Llama-3-Instruct style)."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("chat_bundles")
    ckpt = base / "chatml_ckpt"
    make_chat_checkpoint(ckpt, "chatml")
    im_end, eot = _ids(ckpt, "<|im_end|>", "<|endoftext|>")
    (ckpt / "generation_config.json").write_text(json.dumps({**GREEDY_CONFIG, "eos_token_id": [im_end, eot]}))
    export_pair(ckpt, ckpt, base / "chatml", ExportOptions(progress=False))
    ckpt3 = base / "llama3_ckpt"
    make_chat_checkpoint(ckpt3, "llama3", seed=1)
    eos = _ids(ckpt3, "<|end_of_text|>", "<|eot_id|>")
    (ckpt3 / "generation_config.json").write_text(json.dumps({**SAMPLING_CONFIG, "eos_token_id": eos}))
    export_pair(ckpt3, None, base / "llama3", ExportOptions(progress=False))
    return {"chatml": base / "chatml", "chatml_ckpt": ckpt, "llama3": base / "llama3", "llama3_ckpt": ckpt3,
            "chatml_eos": [im_end, eot], "llama3_eos": eos}


@pytest.fixture(scope="module")
def chatml_gen(chat_bundles):
    import specdec_rt

    return specdec_rt.load(chat_bundles["chatml"], threads=1)


def test_manifest_records_chat_assets(chat_bundles):
    m = json.loads((chat_bundles["chatml"] / "manifest.json").read_text())
    assert m["chat"]["template"] == "chat_template.jinja"
    assert m["chat"]["special_tokens"] == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert m["generation_config"] == "generation_config.json"
    assert {"chat_template.jinja", "generation_config.json"} <= set(m["files"])
    assert m["special_tokens"]["eos_token_ids"] == chat_bundles["chatml_eos"]
    assert (chat_bundles["chatml"] / "chat_template.jinja").read_text() == CHATML
    m3 = json.loads((chat_bundles["llama3"] / "manifest.json").read_text())
    assert m3["special_tokens"]["eos_token_ids"] == chat_bundles["llama3_eos"]
    assert m3["chat"]["special_tokens"]["bos_token"] == "<|begin_of_text|>"


def test_named_templates_in_a_bundle(tmp_path):
    from specdec_rt.export.pipeline import ExportOptions, export_pair
    from specdec_rt.runtime.core.bundle import load_bundle

    ckpt = make_chat_checkpoint(tmp_path / "ckpt", "named")
    export_pair(ckpt, None, tmp_path / "b", ExportOptions(progress=False, validate=False))
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["chat"]["template"] == {"default": "chat_templates/default.jinja",
                                     "tool_use": "chat_templates/tool_use.jinja", "misc": "chat_templates/misc.jinja"}
    b = load_bundle(tmp_path / "b")
    assert b.chat_template["misc"] == MISC and b.generation_config is not None
    rendered = ChatTemplate(b.chat_template, b.special_token_strings).render(WITH_SYSTEM, chat_template="misc")
    assert rendered == _hf(ckpt).apply_chat_template(WITH_SYSTEM, tokenize=False, add_generation_prompt=True,
                                                     chat_template="misc")


def test_chat_equals_transformers_greedy(chat_bundles, chatml_gen):
    """Prompt ids, then the reply token for token (the config's do_sample=False wins over its temperature)."""
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = chat_bundles["chatml_ckpt"]
    hf_ids = _hf(ckpt).apply_chat_template(WITH_SYSTEM, tokenize=True, add_generation_prompt=True,
                                           return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():  # generate() applies the checkpoint's generation_config: greedy, both EOS ids
        ref = model.generate(torch.tensor([hf_ids]), max_new_tokens=24, pad_token_id=0)[0, len(hf_ids):].tolist()
    for kw in (dict(), dict(num_draft_tokens=3), dict(drafter=None), dict(drafter="prompt_lookup")):
        res = chatml_gen.chat(WITH_SYSTEM, max_new_tokens=24, **kw)
        assert res.prompt_token_ids == hf_ids
        assert res.token_ids == ref, kw
    assert chatml_gen.apply_chat_template(WITH_SYSTEM, tokenize=True) == hf_ids


def test_chat_stream_and_history(chatml_gen):
    from specdec_rt.runtime.api.generator import GenerationResult, GenerationStats

    res = GenerationResult("", [], GenerationStats())
    pieces = list(chatml_gen.chat_stream(MULTI_TURN, max_new_tokens=16, result=res, ignore_eos=True))
    full = chatml_gen.chat(MULTI_TURN, max_new_tokens=16, ignore_eos=True)
    assert "".join(pieces) == res.text == full.text and res.token_ids == full.token_ids
    nxt = MULTI_TURN + [{"role": "assistant", "content": full.text}, {"role": "user", "content": "and?"}]
    assert chatml_gen.apply_chat_template(nxt).startswith(chatml_gen.apply_chat_template(MULTI_TURN, False))


def test_chat_errors(chatml_gen, tiny_gen):
    with pytest.raises(ChatTemplateError, match="this bundle has no chat template"):
        tiny_gen.chat(MULTI_TURN)
    with pytest.raises(ChatTemplateError, match="no 'role'"):
        chatml_gen.chat([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        chatml_gen.chat([])


def test_several_eos_ids_stop_generation(chat_bundles, chatml_gen, tmp_path):
    import specdec_rt

    free = chatml_gen.chat(MULTI_TURN, max_new_tokens=12, ignore_eos=True).token_ids
    stop_at = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    unused = next(t for t in range(chatml_gen.vocab_size) if t not in free)
    b = tmp_path / "b"
    shutil.copytree(chat_bundles["chatml"], b)
    m = json.loads((b / "manifest.json").read_text())
    m["special_tokens"]["eos_token_ids"] = [unused, free[stop_at]]
    (b / "manifest.json").write_text(json.dumps(m))
    res = specdec_rt.load(b, threads=1).chat(MULTI_TURN, max_new_tokens=12)
    assert res.token_ids == free[:stop_at + 1] and res.finish_reason == "eos"


def test_tampered_template_is_refused(chat_bundles, tmp_path):
    import specdec_rt

    b = tmp_path / "b"
    shutil.copytree(chat_bundles["chatml"], b)
    (b / "chat_template.jinja").write_text(CHATML.replace("You are Qwen", "You are evil"))
    with pytest.raises(BundleError, match="chat_template.jinja.*sha256"):
        specdec_rt.load(b)


def test_old_bundle_without_chat_assets_loads(chat_bundles, tmp_path):
    import specdec_rt

    b = tmp_path / "old"
    shutil.copytree(chat_bundles["chatml"], b)
    m = json.loads((b / "manifest.json").read_text())
    for key in ("chat", "generation_config"):
        del m[key]
    for f in ("chat_template.jinja", "generation_config.json"):
        del m["files"][f]
        (b / f).unlink()
    (b / "manifest.json").write_text(json.dumps(m))
    gen = specdec_rt.load(b, threads=1)
    assert gen.chat_template is None and not gen.generation_defaults.from_bundle
    with pytest.raises(ChatTemplateError, match="this bundle has no chat template"):
        gen.chat(MULTI_TURN)
    assert len(gen.generate("def f():", max_new_tokens=4, ignore_eos=True).token_ids) == 4


# -- generation_config defaults ---------------------------------------------------------------------

def test_greedy_config_ignores_its_temperature(chatml_gen):
    d = chatml_gen.generation_defaults
    assert (d.do_sample, d.temperature, d.top_k, d.top_p, d.from_bundle) == (False, 0.7, 5, 1.0, True)
    greedy = chatml_gen.generate("def f(x):", max_new_tokens=12, temperature=0, ignore_eos=True).token_ids
    assert chatml_gen.generate("def f(x):", max_new_tokens=12, ignore_eos=True).token_ids == greedy
    # an explicit temperature > 0 samples, with the config's top_k
    # (a fixed K: "auto" picks K from timings, and a seed reproduces sampled tokens only at the same K)
    a = chatml_gen.generate("def f(x):", max_new_tokens=12, temperature=1.5, seed=3, ignore_eos=True,
                            num_draft_tokens=3).token_ids
    b = chatml_gen.generate("def f(x):", max_new_tokens=12, temperature=1.5, top_k=5, top_p=1.0, seed=3,
                            ignore_eos=True, num_draft_tokens=3).token_ids
    assert a == b


def test_sampling_config_is_the_default(chat_bundles):
    import specdec_rt

    gen = specdec_rt.load(chat_bundles["llama3"], threads=1)
    d = gen.generation_defaults
    assert (d.do_sample, d.temperature, d.top_k, d.top_p) == (True, 0.6, 50, 0.9)  # top_k: transformers' 50
    # a fixed K: a seed reproduces sampled tokens only then ("auto" picks K from timings)
    run = lambda **kw: gen.chat(MULTI_TURN, max_new_tokens=10, ignore_eos=True, drafter="prompt_lookup",  # noqa: E731
                                num_draft_tokens=4, **kw).token_ids
    explicit = [run(temperature=0.6, top_k=50, top_p=0.9, seed=s) for s in range(4)]
    assert [run(seed=s) for s in range(4)] == explicit
    assert len({tuple(x) for x in explicit}) > 1  # it really samples
    greedy = run(do_sample=False)
    assert run(temperature=0) == greedy and run(temperature=0, seed=1) == greedy
    assert run(top_k=1, seed=5) == greedy  # top_k=1 sampling is greedy: the explicit top_k won


@pytest.mark.parametrize("config, args, want", [
    (None, {}, (0.0, 0, 1.0)),
    (None, dict(temperature=0.8), (0.8, 0, 1.0)),
    (None, dict(do_sample=True), (1.0, 0, 1.0)),
    ({}, dict(temperature=0.8), (0.8, 50, 1.0)),
    ({"do_sample": False, "temperature": 0.7, "top_p": 0.5}, {}, (0.0, 0, 1.0)),
    ({"do_sample": False, "temperature": 0.7, "top_p": 0.5}, dict(do_sample=True), (0.7, 50, 0.5)),
    ({"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}, {}, (0.7, 20, 0.8)),
    ({"do_sample": True, "temperature": 0.7, "top_k": 20}, dict(top_p=0.5, top_k=0), (0.7, 0, 0.5)),
    ({"do_sample": True, "temperature": 0.7}, dict(do_sample=False, top_k=3), (0.0, 3, 1.0)),
    ({"do_sample": True, "temperature": 0.7}, dict(temperature=0), (0.0, 0, 1.0)),
    ({"do_sample": True, "temperature": None, "top_k": None}, {}, (1.0, 50, 1.0)),
])
def test_sampling_resolution(config, args, want):
    from specdec_rt.runtime.core.gen_config import GenerationDefaults

    assert GenerationDefaults.from_config(config).resolve(**args) == want


def test_resolution_follows_transformers_generation_config():
    """Where our API and transformers' agree in meaning, the resolved values are transformers'."""
    from transformers import GenerationConfig

    from specdec_rt.runtime.core.gen_config import GenerationDefaults

    for cfg in ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, {"do_sample": True, "top_k": 20},
                {"do_sample": True}):
        hf = GenerationConfig(**cfg)
        hf.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
        assert GenerationDefaults.from_config(cfg).resolve() == (hf.temperature, hf.top_k, hf.top_p)


def test_config_errors_and_ignored_fields():
    from specdec_rt.errors import SamplingParamsError
    from specdec_rt.runtime.core.gen_config import GenerationDefaults

    with pytest.raises(SamplingParamsError, match="generation_config.json"):
        GenerationDefaults.from_config({"do_sample": True, "temperature": 0.0}).resolve()
    assert GenerationDefaults.from_config({"do_sample": True, "temperature": 0.0}).resolve(temperature=0.5)
    d = GenerationDefaults.from_config({"repetition_penalty": 1.05, "min_p": 0.0, "typical_p": 1.0})
    assert d.ignored == ("min_p=0.0", "repetition_penalty=1.05")


def test_unsupported_config_fields_warn_at_load(chat_bundles, tmp_path):
    import hashlib

    import specdec_rt

    b = tmp_path / "b"
    shutil.copytree(chat_bundles["chatml"], b)
    gc = b / "generation_config.json"
    gc.write_text(json.dumps({**json.loads(gc.read_text()), "repetition_penalty": 1.1}))
    m = json.loads((b / "manifest.json").read_text())
    m["files"]["generation_config.json"] = hashlib.sha256(gc.read_bytes()).hexdigest()
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match="repetition_penalty=1.1"):
        specdec_rt.load(b, threads=1)


# -- command line ---------------------------------------------------------------------------------

def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "specdec_rt.cli.run_cli", *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=180)


def test_cli_chat_keeps_the_conversation(chat_bundles, chatml_gen):
    proc = _cli("--bundle", chat_bundles["chatml"], "--chat", "--system", "Be brief.", "--json",
                "--max-new-tokens", "6", "--ignore-eos", "--threads", "1", stdin="Hello\n\nWhat is 2+2?\n")
    assert proc.returncode == 0, proc.stderr
    turns = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(turns) == 2
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = chatml_gen.chat(history, max_new_tokens=6, ignore_eos=True)
    assert turns[0]["token_ids"] == first.token_ids
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "What is 2+2?"}]
    assert turns[1]["token_ids"] == chatml_gen.chat(history, max_new_tokens=6, ignore_eos=True).token_ids


def test_cli_chat_streams_text(chat_bundles, chatml_gen):
    proc = _cli("--bundle", chat_bundles["chatml"], "--chat", "--max-new-tokens", "6", "--ignore-eos",
                "--threads", "1", stdin="Hello\n")
    assert proc.returncode == 0, proc.stderr
    want = chatml_gen.chat([{"role": "user", "content": "Hello"}], max_new_tokens=6, ignore_eos=True).text
    assert proc.stdout == want + "\n"


def test_cli_chat_without_template_falls_back(tiny_pair, tiny_gen):
    proc = _cli("--bundle", tiny_pair["bundle"], "--chat", "--max-new-tokens", "5", "--ignore-eos", "--json",
                stdin="def f(x):\nclass A:\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("no chat template") == 1 and len(proc.stderr.splitlines()) == 1
    turns = [json.loads(line) for line in proc.stdout.splitlines()]
    assert turns[1]["token_ids"] == tiny_gen.generate("class A:", max_new_tokens=5, ignore_eos=True).token_ids


def test_cli_chat_template_error_is_one_line(chat_bundles, tmp_path):
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    ckpt = make_chat_checkpoint(tmp_path / "ckpt", "gemma")
    export_pair(ckpt, None, tmp_path / "b", ExportOptions(progress=False, validate=False))
    proc = _cli("--bundle", tmp_path / "b", "--chat", "--system", "Be brief.", "--max-new-tokens", "3",
                stdin="Hello\n")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: the chat template refused this conversation: System role not supported"


def test_cli_flags_fall_back_to_bundle_defaults(chat_bundles):
    import specdec_rt

    gen = specdec_rt.load(chat_bundles["llama3"], threads=1)
    base = ("--bundle", chat_bundles["llama3"], "--prompt", "def f(x):", "--max-new-tokens", "8",
            "--ignore-eos", "--json", "--drafter", "none")
    sampled = json.loads(_cli(*base, "--seed", "4").stdout)["token_ids"]
    assert sampled == gen.generate("def f(x):", max_new_tokens=8, ignore_eos=True, seed=4, drafter=None).token_ids
    assert sampled == gen.generate("def f(x):", max_new_tokens=8, ignore_eos=True, seed=4, drafter=None,
                                   temperature=0.6, top_k=50, top_p=0.9).token_ids
    greedy = json.loads(_cli(*base, "--temperature", "0").stdout)["token_ids"]
    assert greedy == gen.generate("def f(x):", max_new_tokens=8, ignore_eos=True, drafter=None,
                                  do_sample=False).token_ids
    proc = _cli(*base, "--system", "x")
    assert proc.returncode == 2 and "--system needs --chat" in proc.stderr


def test_chat_runtime_never_imports_torch_or_export(chat_bundles):
    code = (
        "import sys, specdec_rt\n"
        f"g = specdec_rt.load({str(chat_bundles['llama3'])!r})\n"
        "r = g.chat([{'role': 'user', 'content': 'hi'}], max_new_tokens=4, seed=0, drafter=None)\n"
        "assert r.token_ids and 'jinja2' in sys.modules\n"
    )
    assert_runs_without(code, **RUNTIME_FORBIDDEN)


def test_server_uses_bundle_defaults(chat_bundles):
    """POST /generate (specdec-serve) fills the sampling fields a body leaves out from the bundle's
    generation_config defaults."""
    import http.client

    pytest.importorskip("starlette")
    import specdec_rt
    from test_serving import serve

    with serve(chat_bundles["llama3"]) as (url, _app):
        host, port = url[len("http://"):].split(":")

        def post(body):
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            out = json.loads(resp.read())
            conn.close()
            assert resp.status == 200, out
            return out["token_ids"]

        gen = specdec_rt.load(chat_bundles["llama3"], threads=1)
        kw = dict(max_new_tokens=8, ignore_eos=True, seed=2)
        assert post({"prompt": "def f(x):", **kw}) == gen.generate("def f(x):", drafter=None, **kw).token_ids
        assert post({"prompt": "def f(x):", "do_sample": False, **kw}) == \
            gen.generate("def f(x):", drafter=None, temperature=0, **kw).token_ids
