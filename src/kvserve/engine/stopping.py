"""When a sequence stops: every rule in one place.

* Token rules, checked by the scheduler right after a token is sampled (`check_stop_token`):
  EOS (unless ignore_eos) and stop token ids once min_tokens are out, max_tokens,
  max_model_len.
* Stop strings, checked by the engine on the detokenized text (`StopStrings`): the match that
  starts first in the text wins (not the first in the request's list), the text is cut there
  (or after it with include_stop_str_in_output), and while running, the tail that could still
  become a stop string is held back from the client.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.request import Request, RequestStatus


def check_stop_token(request: Request, max_model_len: int) -> RequestStatus | None:
    """Token-level stop after a token was appended; sets request.stop_reason when a stop token
    id matched."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_id_set:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def earliest_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """(position, stop string) of the match that starts first in text[start:], the longer
    one on a tie; None when none occurs."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (best is None or (at, -len(stop)) < (best[0], -len(best[1]))):
            best = (at, stop)
    return best


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings.  The number and length of strings are capped by the request
    limits, so a scan costs O(new text + longest stop) per token."""

    stops: tuple[str, ...] = ()
    include_in_output: bool = False

    @property
    def longest(self) -> int:
        return max((len(s) for s in self.stops), default=0)

    def cut(self, text: str, num_old_chars: int) -> tuple[str, str] | None:
        """When text (of which the first `num_old_chars` were already scanned) now holds a
        stop string: (the text to keep, the stop string); else None."""
        if not self.stops:
            return None
        match = earliest_stop(text, self.stops, max(0, num_old_chars - self.longest + 1))
        if match is None:
            return None
        at, stop = match
        return text[: at + len(stop) if self.include_in_output else at], stop

    def visible(self, text: str, finished: bool) -> str:
        """Text safe to show: while running, hold back what could still become a stop string."""
        if finished or not self.stops or self.include_in_output:
            return text
        return text[: max(0, len(text) - self.longest + 1)]
