"""python -m kvarn_mlx.server --max-kv-bytes: one request's KV cache stays within the budget
(a reply stops with finish_reason "length" before its cache could grow past it; a prompt
that cannot fit is refused with a message naming the flag)."""

import mlx.core as mx
import pytest
from mlx_lm import load

from kvarn_mlx import budget, memory
from kvarn_mlx.config import get_preset
from kvarn_mlx.integration import make_cache
from test_server_mlx import client, get, model_dir, prompt, request, server  # noqa: F401 (fixture)

PRESET, SINK, TAIL = "k4v2_g64", 16, 64  # test_server_mlx's server() flags


def config():
    return get_preset(PRESET, sink=SINK, tail_tokens=TAIL)


def kv_budget(model, max_bytes):
    return budget.KVBudget(model, make_cache(model, config()), max_bytes)


def test_fit_tokens_holds_within_the_budget(model_dir):
    model, _ = load(str(model_dir))
    n = 100
    for max_bytes in (150_000, 250_000):
        kv = kv_budget(model, max_bytes)
        fit = budget.fit_tokens(kv, n, 10_000)
        assert 0 < fit < 10_000
        assert budget.fit_tokens(kv, n, fit) == fit and budget.fit_tokens(kv, n, 3) == 3
        # A real cache fed the prompt in one chunk and then one token at a time holds at most
        # the budget.
        cache, held = make_cache(model, config()), 0
        x = mx.zeros((1, n), mx.int32)
        model(x, cache=cache)
        for _ in range(fit):
            model(x[:, :1], cache=cache)
            mx.eval([c.state for c in cache])
            held = max(held, memory.cache_bytes(cache)["held"])
        assert held <= max_bytes
        # The most tokens the planner's bound allows (it counts the worst order of steps, so
        # this order holds less): one more is cut.
        assert budget.fit_tokens(kv, n, fit + 1) == fit and held > max_bytes / 2
    with pytest.raises(
        budget.BudgetExceeded, match="--max-kv-bytes: the 5000-token prompt does not fit"
    ):
        budget.fit_tokens(kv_budget(model, 150_000), 5000, 10)


def test_server_stops_a_reply_at_the_budget_and_refuses_a_prompt_that_cannot_fit(model_dir):
    model, _ = load(str(model_dir))
    size = 150_000
    kv = kv_budget(model, size)
    with server(model_dir, "--max-kv-bytes", "150000") as (url, _):
        c = client(url)
        r = c.chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": prompt(1, 60)}],
            max_tokens=2000,
            temperature=0.0,
        )
        n, got = r.usage.prompt_tokens, r.usage.completion_tokens
        assert r.choices[0].finish_reason == "length"
        assert got == budget.fit_tokens(kv, n, 2000) < 2000
        held = get(url + f"/v1/kv_stats?request={r.id}")["request"]["held"]
        assert 0 < held <= size
        status, body = request(
            url + "/v1/chat/completions",
            body=(
                b'{"messages": [{"role": "user", "content": "'
                + prompt(2, 3000).encode()
                + b'"}], "max_tokens": 5}'
            ),
            headers={"Content-Type": "application/json"},
        )
        assert (
            status >= 400
            and "--max-kv-bytes: the" in body["error"]
            and "does not fit" in body["error"]
        )
