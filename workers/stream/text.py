"""Text rules of detokenize_stream: where an unfinished UTF-8 character starts, and stop strings.

Pure functions on bytes and str, shared by both decoders of workers/stream/.
"""

from __future__ import annotations

from .state import Options


def unfinished_start(data: bytes) -> int:
    """Where an unfinished UTF-8 character at the end of `data` starts (len(data) when there is none).

    Only a valid start of a character that later bytes can complete is held back; a stray or
    invalid byte is decoded (as U+FFFD) at once, as `detokenize` shows it whatever follows.

    >>> unfinished_start("日".encode()[:2]), unfinished_start(b"a\\x97"), unfinished_start(b"\\xed\\xa0")
    (0, 2, 2)
    """
    n = len(data)
    for k in range(1, min(4, n + 1)):
        b = data[n - k]
        if b < 0x80:
            return n
        if b >= 0xC0:
            try:
                data[n - k:].decode("utf-8")
            except UnicodeDecodeError as e:
                if e.reason == "unexpected end of data" and e.start == 0:
                    return n - k
            return n
    return n


def valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def stop_scan(held: str, new: str, opts: Options, flush: bool) -> tuple[str, str | None, str]:
    """Match stop strings over held + new text: (text to show, matched stop string or None, text now held).

    The match is the stop string that ends earliest (of several ending there, the longest). Without
    a match, the longest tail that is a proper prefix of some stop string is held back, so a stop
    string can never start in text already shown.
    """
    text = held + new
    best, best_end = None, 0
    for s in opts.stop:
        at = text.find(s)
        if at >= 0:
            end = at + len(s)
            if best is None or end < best_end or (end == best_end and len(s) > len(best)):
                best, best_end = s, end
    if best is not None:
        return (text[:best_end] if opts.include_stop_str_in_output else text[:best_end - len(best)]), best, ""
    hold = 0 if flush else prefix_tail(text, opts.stop)
    return text[:len(text) - hold], None, (text[len(text) - hold:] if hold else "")


def prefix_tail(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
