"""Policy parameters as an admin PUT or a --policy-param gives them: any JSON value either
makes a policy or raises PolicyError (the admin API's 400), never anything else (a 500)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import PolicyError
from policies.registry import POLICIES, make_policy

PARAMS = [
    (name, field.name) for name, cls in POLICIES.items() for field in dataclasses.fields(cls.Params)
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text()
    | st.sampled_from(["²", "٣", "1_000", " 7 ", "--5", "9" * 5000, "1e999", "nan", "-inf"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children),
    max_leaves=5,
)


@pytest.mark.parametrize("value", ["²", "9" * 5000, "1e999", "nan", float("inf"), [], {}])
@pytest.mark.parametrize(("policy", "param"), PARAMS)
def test_odd_values_are_a_policy_error(policy: str, param: str, value: object) -> None:
    try:
        make_policy(policy, {param: value})
    except PolicyError as exc:
        assert str(exc)
    else:  # "²" and friends can be accepted only by a parameter that takes any text
        assert isinstance(value, str | dict)


@settings(max_examples=300, deadline=None)
@given(choice=st.sampled_from(PARAMS), value=json_values)
def test_any_json_value_makes_a_policy_or_a_policy_error(choice, value) -> None:
    policy, param = choice
    with contextlib.suppress(PolicyError):  # anything else (ValueError, ...) fails the test
        make_policy(policy, {param: value})
