import random

import pytest

from ops import scenarios
from ops.prompts import PromptError, PromptMaker, load_codec
from tests.ops_fakes import train_tokenizer_json


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    return load_codec(str(train_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json")))


@pytest.fixture(scope="module")
def maker(codec):
    return PromptMaker(codec)


@pytest.mark.parametrize("length", [1, 2, 17, 256, 1000])
def test_prompts_have_exact_token_length(codec, maker, length):
    for offset in (0, 5, maker.corpus_tokens - 3):
        text = maker.make(length, offset)
        assert len(codec.encode(text)) == length


def test_prompt_longer_than_corpus_wraps_and_is_real_text(codec, maker):
    length = maker.corpus_tokens + 300
    text = maker.make(length, 11)
    assert len(codec.encode(text)) == length
    assert "Ishmael" in text and "Bennet" in text


def test_prompt_length_must_be_positive(maker):
    with pytest.raises(PromptError):
        maker.make(0, 0)


def test_bad_tokenizer_source_is_a_clear_error(tmp_path):
    with pytest.raises(PromptError, match="does not exist"):
        load_codec(str(tmp_path / "nope.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(PromptError, match="cannot read tokenizer"):
        load_codec(str(bad))


def test_interference_workload(maker, codec):
    injections = scenarios.parse_injections("1024@6, 256@2")
    specs = scenarios.interference(
        maker,
        random.Random(1),
        decoders=3,
        decoder_prompt_len=32,
        decoder_tokens=100,
        injections=injections,
        injected_tokens=4,
    )
    decoders = [s for s in specs if s.role == "decoder"]
    injected = [s for s in specs if s.role == "injected"]
    assert [(s.arrival_s, s.max_tokens) for s in decoders] == [(0.0, 100)] * 3
    assert [(s.prompt_len, s.arrival_s) for s in injected] == [(256, 2.0), (1024, 6.0)]
    assert all(len(codec.encode(s.prompt)) == s.prompt_len for s in specs)
    assert len({s.prompt for s in specs}) == len(specs)
    assert [s.index for s in specs] == list(range(len(specs)))


def test_same_seed_same_workload_other_seed_other_workload(maker):
    def build(seed):
        return scenarios.poisson(
            maker,
            random.Random(seed),
            rate=5,
            duration_s=4,
            prompt=scenarios.LengthRange(8, 64),
            output=scenarios.LengthRange(4, 16),
        )

    first, again, other = build(3), build(3), build(4)
    assert first == again
    assert first != other
    assert all(0 < s.arrival_s < 4 for s in first)
    assert all(8 <= s.prompt_len <= 64 and 4 <= s.max_tokens <= 16 for s in first)
    arrivals = [s.arrival_s for s in first]
    assert arrivals == sorted(arrivals)


def test_throughput_and_tenants(maker):
    fixed = scenarios.throughput(
        maker,
        random.Random(0),
        requests=5,
        prompt=scenarios.parse_length_range("20"),
        output=scenarios.parse_length_range("7"),
    )
    assert [(s.arrival_s, s.prompt_len, s.max_tokens) for s in fixed] == [(0.0, 20, 7)] * 5
    mixed = scenarios.tenants(
        maker,
        random.Random(0),
        heavy_requests=3,
        heavy_prompt=scenarios.LengthRange(100, 100),
        heavy_output=scenarios.LengthRange(50, 50),
        light_rate=4,
        duration_s=2,
        light_prompt=scenarios.LengthRange(10, 10),
        light_output=scenarios.LengthRange(5, 5),
    )
    heavy = [s for s in mixed if s.tenant == "heavy"]
    light = [s for s in mixed if s.tenant == "light"]
    assert len(heavy) == 3 and all(s.arrival_s == 0 and s.prompt_len == 100 for s in heavy)
    assert light and all(s.prompt_len == 10 and s.role == "light" for s in light)


@pytest.mark.parametrize("bad", ["", "12", "x@1", "100@-1", "0@1", "100@"])
def test_bad_injections_are_rejected(bad):
    with pytest.raises(ValueError):
        scenarios.parse_injections(bad)


@pytest.mark.parametrize("bad", ["0", "9:3", "a", "1:b"])
def test_bad_length_ranges_are_rejected(bad):
    with pytest.raises(ValueError):
        scenarios.parse_length_range(bad)
