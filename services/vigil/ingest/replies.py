"""Is a chat reply a clear yes or no? A small fixed vocabulary, nothing cleverer.

A reply to an approval question answers it only when its whole text, folded (Unicode NFKC,
case-folded, punctuation, symbols and spaces around it dropped), is one of the words below:
"yes, but only 10 euros" or "hmm" is unclear and goes to the agent as a message, which may
ask again. Guessing wrong here runs a tool nobody approved, so the list is short and every
entry means one thing on its own; "ok" and "sure" are in, "fine" and "maybe" are not.
"""

from __future__ import annotations

import unicodedata

from vigil.ledger.states import ApprovalAnswer

YES = frozenset(
    {
        # English
        "yes", "y", "yep", "yeah", "ok", "okay", "sure", "approve", "approved", "go ahead", "do it",
        # French, Spanish, Italian, Portuguese, German, Dutch
        "oui", "sí", "si", "sim", "ja", "jawohl",
        # Japanese
        "はい", "うん", "ええ", "承認", "承認します", "お願いします", "どうぞ", "了解",
    }
)  # fmt: skip
NO = frozenset(
    {
        "no", "n", "nope", "nah", "deny", "denied", "reject", "don't", "dont", "do not", "stop", "cancel",
        "non", "nein", "nee", "não", "nao",
        "いいえ", "いや", "だめ", "ダメ", "駄目", "拒否", "やめて", "いらない",
    }
)  # fmt: skip
# Longest accepted text: anything longer is a sentence, not an answer.
MAX_ANSWER_CHARS = 32


def _trim(text: str) -> str:
    # Drop punctuation, symbols (an emoji, "!", "。") and separators at both ends only: "do it!"
    # is "do it", but "no, wait" keeps its comma and is unclear.
    def edge(ch: str) -> bool:
        return unicodedata.category(ch)[0] in "PSZC"

    start, end = 0, len(text)
    while start < end and edge(text[start]):
        start += 1
    while end > start and edge(text[end - 1]):
        end -= 1
    return " ".join(text[start:end].split())


def clear_answer(text: str) -> ApprovalAnswer | None:
    """``yes`` or ``no`` when ``text`` is clearly one; None when unclear."""
    if len(text) > MAX_ANSWER_CHARS * 4:
        return None
    folded = _trim(unicodedata.normalize("NFKC", text).casefold().replace("\u2019", "'"))
    if not folded or len(folded) > MAX_ANSWER_CHARS:
        return None
    if folded in YES:
        return ApprovalAnswer.YES
    if folded in NO:
        return ApprovalAnswer.NO
    return None
