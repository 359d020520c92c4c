"""Streaming detokenisation that never emits a broken UTF-8 character, with stop strings."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of recent tokens both with and without the newest one and emits the
    difference, holding back text while it ends in U+FFFD (an incomplete multi-byte character)
    or could still be the start of a stop string.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all generated text so far (decoded)
        self.emitted = 0  # chars of self.text already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def find_stop(self) -> int | None:
        """Index in self.text where the first stop string starts, searching only new text."""
        if not self.stop:
            return None
        start = max(0, self.emitted - self.hold)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def take(self, final: bool, cut: int | None = None) -> str:
        """The next text delta. Until `final`, keep back what could begin a stop string."""
        end = len(self.text) if cut is None else cut
        if not final and cut is None and self.hold:
            end = max(self.emitted, end - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta
