"""The sampling fields of the wire type: names, defaults, validation, JSON round trip."""

from __future__ import annotations

import pytest

from engine.api.generate import ApiValidationError, SamplingParams


def test_new_fields_have_the_agreed_names_and_defaults_and_cost_nothing_by_default() -> None:
    p = SamplingParams()
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_p,
            p.min_tokens, p.logit_bias) == (1.0, 0.0, 0.0, 0.0, 0, None)
    assert not p.uses_processors
    assert SamplingParams.from_json({}) == p
    for kw in ({"repetition_penalty": 1.1}, {"frequency_penalty": 0.5},
               {"presence_penalty": -0.5}, {"min_tokens": 1}, {"logit_bias": {3: 1.0}}):
        assert SamplingParams(**kw).uses_processors, kw
    assert not SamplingParams(min_p=0.1).uses_processors  # min_p acts after temperature


def test_round_trip_and_logit_bias_on_the_wire() -> None:
    p = SamplingParams(max_tokens=8, repetition_penalty=1.3, frequency_penalty=-2.0,
                       presence_penalty=2.0, min_p=0.05, min_tokens=8,
                       logit_bias={5: -100, 17: 2.5})
    wire = p.to_json()
    assert wire["logit_bias"] == {"5": -100.0, "17": 2.5}
    assert SamplingParams.from_json(wire) == p
    assert SamplingParams(logit_bias={}).logit_bias is None
    hash(p)  # still usable as a key


@pytest.mark.parametrize("sampling, field", [
    ({"repetition_penalty": 0}, "sampling.repetition_penalty"),
    ({"repetition_penalty": -1.0}, "sampling.repetition_penalty"),
    ({"frequency_penalty": 2.5}, "sampling.frequency_penalty"),
    ({"presence_penalty": -2.01}, "sampling.presence_penalty"),
    ({"min_p": 1.5}, "sampling.min_p"),
    ({"min_p": -0.1}, "sampling.min_p"),
    ({"min_tokens": -1}, "sampling.min_tokens"),
    ({"min_tokens": 17, "max_tokens": 16}, "sampling.min_tokens"),
    ({"min_tokens": 1.5}, "sampling.min_tokens"),
    ({"logit_bias": [1, 2]}, "sampling.logit_bias"),
    ({"logit_bias": {"x": 1}}, "sampling.logit_bias"),
    ({"logit_bias": {"-3": 1}}, "sampling.logit_bias"),
    ({"logit_bias": {"3": 100.5}}, "sampling.logit_bias.3"),
    ({"logit_bias": {"3": "1"}}, "sampling.logit_bias.3"),
])
def test_bad_values_name_the_field(sampling, field) -> None:
    with pytest.raises(ApiValidationError) as err:
        SamplingParams.from_json(sampling)
    assert err.value.field == field
