"""Twenty clients of python -m apps.chat (kvarn_mlx.server, batched KVarN
caches) at once that hang up at random points (mid-header, mid-body, right
after sending, mid-stream): every generation they started is stopped (the
server's live sequences drop to none, long before their max_tokens), and the
next request is answered exactly as before. A tiny random-weight model in a
subprocess, which never says end-of-turn: only a stop ends its replies."""

import json
import random
import socket
import struct
import threading
import time

import httpx
import pytest

from chat_server import TIMEOUT, chat_app, post, user, wait_for
from model_folder import tiny_model_folder

CLIENTS = 20
LONG = 100_000  # max_tokens of the abandoned replies: minutes of decoding if they were not stopped
STORY = "Write a very long story about the sea."
POINTS = ("head", "body", "sent", "events")
# mlx-lm notices a client that left when it writes to it: streams only (a whole
# reply is written once it is done), so whole-reply clients leave before sending it all.
WHOLE_REPLY_POINTS = ("head", "body")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disconnect")
    model = tiny_model_folder(tmp / "tiny")
    with chat_app(
        tmp / "saved",
        "--model",
        str(model),
        "--kv-preset",
        "k4v2_g64",
        "--kv-sink",
        "16",
        "--prompt-cache-size",
        "0",
    ) as url:
        yield url


def request(port, stream):
    body = json.dumps(
        {"messages": user(STORY), "max_tokens": LONG, "temperature": 0, "stream": stream}
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head, body


def client(port, plan, start, done):
    head, body = request(port, plan["stream"])
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    if plan["reset"]:  # close with a TCP reset instead of a clean FIN
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    try:
        start.wait()
        point = plan["point"]
        if point == "head":
            s.sendall(head[: plan["cut"] % len(head)])
        elif point == "body":
            s.sendall(head + body[: plan["cut"] % len(body)])
        else:
            s.sendall(head + body)
            if (
                point == "events"
            ):  # read a few SSE data lines (the role chunk, then tokens), then leave
                seen, buf = 0, b""
                while seen < plan["events"] and (chunk := s.recv(4096)):
                    buf += chunk
                    seen = buf.count(b"\ndata: ")
    finally:
        s.close()
        done.append(plan)


def live(url):
    return httpx.get(url + "/v1/kv_stats", timeout=TIMEOUT).json()["live"]


def processed(url):
    return httpx.get(url + "/v1/kv_stats", timeout=TIMEOUT).json()["prompt_tokens_processed"]


def test_twenty_clients_hang_up_at_random_points(app):
    url, port = app, int(app.rsplit(":", 1)[1])
    rng = random.Random(12)
    plans = [
        {
            "point": rng.choice(POINTS),
            "stream": rng.random() < 0.6,
            "reset": rng.random() < 0.3,
            "cut": rng.randrange(1, 10**6),
            "events": rng.randint(1, 5),
        }
        for _ in range(CLIENTS)
    ]
    for p in plans:
        p["stream"] |= p["point"] not in WHOLE_REPLY_POINTS
    reference = post(
        url + "/v1/chat/completions", {"messages": user("Hi"), "max_tokens": 3, "temperature": 0}
    )
    assert reference.status_code == 200
    before = processed(url)

    start, done, seen = threading.Barrier(CLIENTS), [], []
    threads = [threading.Thread(target=client, args=(port, p, start, done)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(done) == CLIENTS, "a client could not hang up"
    began = time.monotonic()

    # Every generation a client started is stopped: none is left, and none comes back.
    def idle():
        seen.append(live(url))
        return seen[-1]["sequences"] == 0

    wait_for(idle, "the server to drop the abandoned generations", timeout=60)
    stopped = time.monotonic() - began
    time.sleep(2)
    assert live(url)["sequences"] == 0
    assert (
        max(s["sequences"] for s in seen) > 0 or processed(url) > before
    )  # generations had started
    print(
        f"live sequences after the clients left: {[s['sequences'] for s in seen[:10]]}; none after "
        f"{stopped:.1f} s"
    )

    again = post(
        url + "/v1/chat/completions", {"messages": user("Hi"), "max_tokens": 3, "temperature": 0}
    )
    assert again.status_code == 200
    assert again.json()["choices"] == reference.json()["choices"]
