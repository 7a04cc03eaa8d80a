"""Stop strings, matched on the decoded text of each sequence (a stop string can tokenize
differently inside a stream than on its own), over a window just wide enough for the newest
segment to complete a match."""

from __future__ import annotations

from typing import Optional

from mlx_ssp.rollout.records import LiveSequence


class StopMatcher:
    def __init__(self, stop_strings: list[str]):
        self.stop_strings = list(stop_strings)
        self.max_stop = max((len(s) for s in self.stop_strings), default=0)

    def __bool__(self) -> bool:
        return bool(self.stop_strings)

    def scan(self, seq: LiveSequence, token: int) -> Optional[str]:
        """Feed ``token`` to the sequence's detokenizer; the stop string it completes (the earliest
        in the window), or None."""
        seq.detok.add_token(token)
        seg = seq.detok.last_segment
        if not seg:
            return None
        window_start = max(0, len(seq.text) - self.max_stop + 1)
        seq.text += seg
        window = seq.text[window_start:]
        hits = [(window.find(s), s) for s in self.stop_strings if s in window]
        return min(hits)[1] if hits else None
