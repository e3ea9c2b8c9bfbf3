"""L1 through a real worker under hostile input: memory and CPU stay bounded (issue 11, row 1).

An input made of nothing but one special token has a boundary every few bytes. A lookup that copied
the prefix at every boundary held O(input x boundaries) ids: ~810 KB of repeated
`<｜end▁of▁sentence｜>` took a worker to 1.8 GiB. The worker's peak resident size is read from
/proc (VmHWM, reset just before the request through clear_refs) and its CPU seconds from
/proc/PID/stat; wall time is never asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import QWEN_TIKTOKEN, cpu_seconds, serving, status_bytes, wait_until

from tokenbroker.workers.tokenizers import load_tokenizer

EOS = "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
IM_END = "<|im_end|>"
# (model flags, model name, the special repeated, what a conversation appends): DeepSeek's
# tokenizer.json and Qwen's tiktoken file (a boundary every 10 bytes: 12.5 GiB in one process before).
MODELS = {
    "deepseek": ((), "", EOS, f"{USER}and now a question{ASSISTANT}"),
    "qwen": (("--model", f"qwen={QWEN_TIKTOKEN}"), "qwen", IM_END, "<|im_start|>user\nand now a question<|im_end|>\n"),
}
MiB = 1 << 20
L1_BUDGET = 16 * MiB
# Peak growth allowed over the resident size before the request: the L1 budget, the reply (ids as a
# list and as MessagePack), the input in a few forms (str, UTF-8, pieces) and allocator slack.
# The quadratic copies this guards against took 1.7 GiB on ~810 KB; now it is under 10 MiB.
PEAK_GROWTH_LIMIT = L1_BUDGET + 64 * MiB
# CPU seconds the worker may spend on both requests (a miss, then a hit); plain encoding of the
# input takes ~0.1 s, the quadratic copies took 5.8 s on 1.08 MB; now both take ~0.2 s.
CPU_LIMIT = 1.5


def reset_peak(pid: int) -> bool:
    """Start VmHWM afresh at the current resident size (Linux 4.0+, same user); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@pytest.mark.parametrize(("model", "nbytes"), [("deepseek", 810_000), ("deepseek", 1_080_000), ("qwen", 810_000)])
def test_input_of_repeated_special_tokens_keeps_the_worker_within_its_memory_bound(model: str, nbytes: int) -> None:
    flags, name, special, more = MODELS[model]
    tok = load_tokenizer(str(QWEN_TIKTOKEN) if model == "qwen" else "embedded:deepseek")
    text = special * (nbytes // len(special.encode()))
    want = tok.encode(text)
    fields = {"model": name} if name else {}
    with serving(*flags, "--tokenizer-cache-enable-l1", "--tokenizer-cache-l1-max-memory", str(L1_BUDGET),
                 workers=1) as (broker, c):
        assert c.call("tokenize", text="warm up", **fields)["ok"] is True
        (pid,) = wait_until(broker.worker_pids, what="the worker's pid")
        rss_before = status_bytes(pid, "VmRSS")
        if not reset_peak(pid):
            pytest.skip("cannot reset the worker's peak resident size (/proc/PID/clear_refs)")
        cpu_before = cpu_seconds(pid)
        for _ in range(2):  # an L1 miss that stores prefixes, then a lookup that finds them
            reply = c.call("tokenize", text=text, timeout=120, **fields)
            assert reply["ok"] is True and reply["tokens"] == want
        peak = status_bytes(pid, "VmHWM")
        cpu = cpu_seconds(pid) - cpu_before
        assert peak - rss_before <= PEAK_GROWTH_LIMIT, f"worker peak grew {(peak - rss_before) / MiB:.0f} MiB"
        assert cpu <= CPU_LIMIT, f"worker spent {cpu:.2f} CPU seconds"
        # The worker still serves, and its L1 still helps a conversation that extends the input.
        longer = text + more
        reply = c.call("tokenize", text=longer, timeout=120, **fields)
        assert reply["ok"] is True and reply["tokens"] == tok.encode(longer)
