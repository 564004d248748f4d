"""Cleaning one document: newlines, Unicode NFC, control characters, length limits.

`clean_text` returns the cleaned text, or the reason it is rejected. The
content hash (`doc_id`) is taken of the cleaned text, so two documents that
differ only in what cleaning removes are exact duplicates.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

from trainlab.data.prep.spec import CleaningSettings

# Part of the dataset fingerprint: bump it whenever the rules below change, so a
# dataset cleaned by older rules is rebuilt rather than trusted.
CLEANING_RULES_VERSION = 1
CLEANING_RULES = (
    "newlines CRLF/CR -> LF; Unicode NFC; strip control characters (Cc) "
    "except tab and newline; reject empty (whitespace only), too_short, too_long"
)

# Unicode category Cc without tab (\x09) and newline (\x0a); \r is gone by then.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")

REASONS = (
    "empty",
    "too_short",
    "too_long",
    "bad_encoding",
    "malformed_record",
    "missing_field",
    "unreadable",
    "duplicate",
    "near_duplicate",
)


def decode_utf8(data: bytes) -> str | None:
    """Strict UTF-8 (a leading byte-order mark dropped); None when it is not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text[1:] if text.startswith("\ufeff") else text


def clean_text(text: str, settings: CleaningSettings) -> tuple[str, str | None]:
    """(cleaned text, None) for a kept document, or ("", reason) for a rejected one."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if _CONTROL.search(text):
        text = _CONTROL.sub("", text)
    if not text.strip():
        return "", "empty"
    if len(text) < settings.min_chars:
        return "", "too_short"
    if len(text) > settings.max_chars:
        return "", "too_long"
    return text, None


def content_id(text: str) -> str | None:
    """Stable hash of a cleaned text (the `doc_id`); None when the text cannot be
    encoded as UTF-8 (lone surrogates, e.g. from a JSON "\\ud800" escape)."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def hash_fraction(doc_id: str) -> float:
    """A document's position in [0, 1) by its hash: a deterministic sample key."""
    return int(doc_id[:8], 16) / 2**32
