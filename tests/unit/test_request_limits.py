"""Request limits, the O(1) waiting queue and stop strings: pure Python, milliseconds."""

from __future__ import annotations

import pytest

from kvserve.config import RequestLimits
from kvserve.engine.request_queue import RequestQueue
from kvserve.engine.stopping import StopStrings, earliest_stop
from kvserve.errors import ParameterError
from kvserve.request import Request, SamplingParams

LIMITS = RequestLimits(max_prompts_per_request=4, max_sequences_per_request=8,
                       max_stop_strings=2, max_stop_string_length=5, max_logprobs=3)  # fmt: skip


@pytest.mark.parametrize(
    ("num_prompts", "n", "param", "flag"),
    [(5, 1, "prompt", "--max-prompts-per-request"), (3, 3, "n", "--max-sequences-per-request")],
)
def test_fanout_limits_name_the_field_and_the_flag(num_prompts, n, param, flag):
    with pytest.raises(ParameterError) as err:
        LIMITS.check_fanout(num_prompts, n)
    assert err.value.param == param and flag in str(err.value)
    LIMITS.check_fanout(4, 2)  # at the limits: fine


@pytest.mark.parametrize(
    ("params", "param", "fragment"),
    [
        (SamplingParams(stop=["a", "b", "c"]), "stop", "--max-stop-strings"),
        (SamplingParams(stop=["abcdef"]), "stop", "--max-stop-string-length"),
        (SamplingParams(logprobs=4), "logprobs", "at most 3"),
        (SamplingParams(stop_token_ids=[100]), "stop_token_ids", "[0, 100)"),
    ],
)
def test_sampling_params_against_the_vocabulary_and_limits(params, param, fragment):
    with pytest.raises(ParameterError) as err:
        params.check_against(100, LIMITS)
    assert err.value.param == param and fragment in str(err.value)


def test_logprobs_cap_never_exceeds_the_vocabulary():
    with pytest.raises(ParameterError, match="at most 10"):
        SamplingParams(logprobs=11).check_against(10, RequestLimits(max_logprobs=1000))


def test_huge_values_make_short_messages():
    with pytest.raises(ParameterError) as err:
        SamplingParams(stop_token_ids=[-1] * 100_000)
    assert len(str(err.value)) < 200


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="--max-waiting-requests must be positive"):
        RequestLimits(max_waiting_requests=0)


def _request(request_id: str) -> Request:
    return Request(request_id, [1], SamplingParams())


def test_request_queue_keeps_fcfs_order_and_removes_from_anywhere():
    queue = RequestQueue()
    a, b, c, d = map(_request, "abcd")
    for r in (a, b, c):
        queue.append(r)
    assert queue.remove(b) and not queue.remove(b)
    assert [r.request_id for r in queue] == ["a", "c"] and b not in queue and a in queue
    queue.appendleft(d)
    queue.appendleft(b)
    assert [r.request_id for r in queue] == ["b", "d", "a", "c"]
    assert queue.first(2) == [b, d] and queue.first(9) == [b, d, a, c] and len(queue) == 4
    for r in (b, d, a, c):
        assert queue.remove(r)
    assert not queue and queue.first(3) == []


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello world", ("world", "lo"), (3, "lo")),  # first in the text, not in the list
        ("hello world", ("o w", "o"), (4, "o w")),  # a tie at one position: the longer
        ("hello world", ("xyz",), None),
        ("abcabc", ("abc",), (0, "abc")),
    ],
)
def test_earliest_stop_string_in_the_text_wins(text, stops, expected):
    assert earliest_stop(text, stops, 0) == expected


def test_stop_strings_cut_at_the_first_of_one_delta_and_hold_back_a_possible_one():
    stops = StopStrings(("mat", "sat"))
    assert stops.cut("The cat sat on the mat.", 0) == ("The cat ", "sat")
    assert StopStrings(("mat", "sat"), include_in_output=True).cut("a sat mat", 0) == (
        "a sat", "sat")  # fmt: skip
    assert stops.cut("The cat", 0) is None
    assert stops.visible("The cat s", finished=False) == "The cat"  # "s" may start "sat"
    assert stops.visible("The cat s", finished=True) == "The cat s"
    # Only the new text (and a stop's length before it) is scanned.
    assert stops.cut("mat then more", 9) is None
