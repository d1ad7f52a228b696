"""A proposer for speculation tests that need rejections: the tiny models soon repeat one token, which prompt lookup
always guesses right."""
from kvchat.engine.runtime.speculative import PromptLookup


class Misguided(PromptLookup):
    """Prompt lookup that spoils the last draft of every other proposal: verification must reject and take back."""

    calls = 0

    def propose(self, ids, most):
        drafts = super().propose(ids, most)
        self.calls += 1
        if drafts and self.calls % 2:
            drafts[-1] = (drafts[-1] + 1) % 300 + 3
        return drafts
