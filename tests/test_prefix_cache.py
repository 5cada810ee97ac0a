"""Prefix reuse (``load(prefix_cache=...)``): a prompt that starts with what a cache sequence still
holds keeps those positions' K/V, and its output is token for token a fresh prefill's."""
from __future__ import annotations

import numpy as np
import pytest

import specdec_rt
from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.engines.probes import probe_prefix_reuse

MODES = [dict(drafter=None), dict(num_draft_tokens=3), dict(num_draft_tokens="auto"),
         dict(drafter="suffix_hybrid", num_draft_tokens="auto"), dict(speculation="tree", num_draft_tokens=6),
         dict(num_draft_tokens=2, temperature=0.8, seed=5)]


@pytest.fixture(scope="module")
def gens(tiny_pair):
    cached = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=4)
    fresh = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=4, prefix_cache=False)
    assert cached.prefix_cache and not fresh.prefix_cache
    return cached, fresh


def _turns(gen, first: str, follow_ups: list[str], n: int, **kw):
    """A conversation in plain text: each prompt is the last one, its answer and a follow-up."""
    ids = gen.encode_prompt(first)
    for extra in [None, *follow_ups]:
        if extra is not None:
            ids = ids + out + gen.encode_prompt(extra)
        out = gen.generate_ids(ids, max_new_tokens=n, **kw)
        yield ids, out, gen.last_stats


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_next_turn_reuses_the_conversation_and_changes_no_token(gens, mode):
    cached, fresh = gens
    cached.clear_prefix_cache()
    kw = {"temperature": 0.0, **mode}
    held = 0
    for ids, out, stats in _turns(cached, "def parse(line):\n", ["\n# and now\n", "\nclass Reader:\n"], 24, **kw):
        assert out == fresh.generate_ids(ids, max_new_tokens=24, **kw)
        assert fresh.last_stats.cached_prompt_tokens == 0
        # everything the cache held of this prompt: the last prompt and its answer but the last
        # token (whose K/V the next call writes), at least
        assert stats.cached_prompt_tokens >= held
        assert stats.cached_prompt_tokens < len(ids)
        held = len(ids) + len(out) - 1


def test_a_prompt_keeps_only_the_prefix_it_shares(gens):
    cached, fresh = gens
    cached.clear_prefix_cache()
    base = cached.encode_prompt("import os\nimport sys\n\ndef main():\n    ")
    out = cached.generate_ids(base, max_new_tokens=12, temperature=0.0)
    assert cached.last_stats.cached_prompt_tokens == 0
    again = cached.generate_ids(base, max_new_tokens=12, temperature=0.0)  # the same prompt: all but its last token
    assert again == out and cached.last_stats.cached_prompt_tokens == len(base) - 1
    other = base[:5] + [t for t in cached.encode_prompt("zz qq") if t != base[5]][:3]
    assert other[5] != base[5]
    got = cached.generate_ids(other, max_new_tokens=12, temperature=0.0)
    assert cached.last_stats.cached_prompt_tokens == 5
    assert got == fresh.generate_ids(other, max_new_tokens=12, temperature=0.0)
    cached.clear_prefix_cache()
    cached.generate_ids(other, max_new_tokens=4, temperature=0.0)
    assert cached.last_stats.cached_prompt_tokens == 0


def test_batch_rows_land_where_their_conversation_is(gens):
    cached, fresh = gens
    cached.clear_prefix_cache()
    firsts = [cached.encode_prompt(p) for p in ("def wrap(text, width):", "import heapq\n", "class Stack:\n")]
    answers = [r.token_ids for r in cached.generate_batch(firsts, max_new_tokens=16, temperature=0.0)]
    follow = cached.encode_prompt("\n# again\n")
    seconds = [p + a + follow for p, a in zip(firsts, answers)][::-1]  # another order than the first turns
    got = cached.generate_batch(seconds, max_new_tokens=16, temperature=0.0, num_draft_tokens=3)
    want = fresh.generate_batch(seconds, max_new_tokens=16, temperature=0.0, num_draft_tokens=3)
    for g, w, p, a in zip(got, want, firsts[::-1], answers[::-1]):
        assert g.token_ids == w.token_ids
        assert g.stats.cached_prompt_tokens >= len(p) + len(a) - 1


def test_per_user_reuse_stays_within_a_user(tiny_pair):
    gen = specdec_rt.load(tiny_pair["bundle"], threads=1, prefix_cache="per-user")
    ids = gen.encode_prompt("def wrap(text, width):")

    def cached(user):
        gen.generate_ids(ids, max_new_tokens=6, temperature=0.0, user=user)
        return gen.last_stats.cached_prompt_tokens

    assert cached("alice") == 0
    assert cached("bob") == 0  # alice's K/V: not for bob
    assert cached("bob") == len(ids) - 1
    assert cached(None) == 0  # anonymous requests never reuse when isolated
    with pytest.raises(GenerationInputError, match="prefix_cache"):
        specdec_rt.load(tiny_pair["bundle"], threads=1, prefix_cache="sometimes")


def test_cache_is_forgotten_when_the_engine_is_reset_or_repadded(gens):
    cached, _ = gens
    ids = cached.encode_prompt("def wrap(text, width):")
    cached.generate_ids(ids, max_new_tokens=6, temperature=0.0)
    target = cached.target
    assert target.reusable_prefix(ids) == len(ids) - 1
    with target.rows_padded_to(target.min_rows + 1):  # K/V of another kernel path: never mixed
        assert target.reusable_prefix(ids) == 0
    assert target.reusable_prefix(ids) == 0  # forgotten on the way back too
    cached.generate_ids(ids, max_new_tokens=6, temperature=0.0)
    probe_prefix_reuse(target)  # anything that drives the engine itself resets it
    assert target.reusable_prefix(ids) == 0


def test_probe_refuses_reuse_where_prompt_and_decoding_bits_differ(tiny_pair):
    """An engine whose wide calls write other K/V bits than decoding (as a kernel that switches
    paths by row count would): the probe must see it and keep reuse off."""
    from specdec_rt.runtime.engines.ort import OrtEngine

    gen = specdec_rt.load(tiny_pair["bundle"], threads=1)
    assert gen.prefix_cache
    target = gen.target

    class WideCallsDiffer(OrtEngine):
        def forward(self, input_ids, positions, mask, seq=0):
            out = super().forward(input_ids, positions, mask, seq)
            if len(input_ids) > 64:
                p = self.lengths[seq]
                k, _ = self.cache.keys[0], self.cache.values[0]
                k[seq, p:p + len(input_ids)] = np.nextafter(k[seq, p:p + len(input_ids)], np.inf)
            return out

    target.__class__ = WideCallsDiffer
    try:
        assert probe_prefix_reuse(target) is False and not gen.prefix_cache
        ids = gen.encode_prompt("def wrap(text, width):")
        gen.generate_ids(ids, max_new_tokens=6, temperature=0.0)
        gen.generate_ids(ids, max_new_tokens=6, temperature=0.0)
        assert gen.last_stats.cached_prompt_tokens == 0
    finally:
        target.__class__ = OrtEngine
    assert probe_prefix_reuse(target) is True


def test_alternating_conversations_each_keep_their_own_sequence(gens):
    """Two chats taking turns through batch calls (as the server's scheduler runs requests):
    each turn lands on the sequence its conversation's last turn left (the other sequences hold
    the other chat), and unrelated prompts evict the least recently used sequence first, not a
    live conversation. (The one-sequence API keeps one conversation, on sequence 0.)"""
    cached, fresh = gens
    cached.clear_prefix_cache()
    assert cached.target.max_batch == 4
    convs = {"a": cached.encode_prompt("def area(r):\n"), "b": cached.encode_prompt("import json\n")}
    more = cached.encode_prompt("\n# more\n")
    kw = dict(max_new_tokens=10, temperature=0.0, num_draft_tokens=3, batch_size=4)
    for turn in range(3):
        for name, ids in list(convs.items()):
            res = cached.generate_batch([ids], **kw)[0]
            assert res.token_ids == fresh.generate_batch([ids], **kw)[0].token_ids
            if turn:
                assert res.stats.cached_prompt_tokens >= len(ids) - len(more) - 1, (turn, name)
            convs[name] = ids + res.token_ids + more
    for other in ("x = 1\n", "y = 2\n", "z = 3\n"):  # the two empty sequences, then the oldest (a)
        cached.generate_batch([cached.encode_prompt(other)], **kw)
    assert cached.generate_batch([convs["b"]], **kw)[0].stats.cached_prompt_tokens > 0  # b: used after a
    assert cached.generate_batch([convs["a"]], **kw)[0].stats.cached_prompt_tokens == 0  # a: evicted
