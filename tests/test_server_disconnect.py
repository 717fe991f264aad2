"""Twenty clients at once that hang up at random points (mid-header, mid-body,
while queued, mid-stream, while waiting for a whole reply): every generation
they started is cancelled and the engine is free again, and the next request
is answered exactly as before. Checked on the engine's state and events."""

import json
import random
import socket
import struct
import threading
import time

import pytest

from chat_server import TIMEOUT, chat_worker, post, serve, user, wait_for

from apps.chat.server import create_app  # noqa: E402

CLIENTS = 20
LONG = 2000  # max_tokens of the abandoned replies: far more than any of them may run
STORY = "Write a very long story about the sea."  # the model goes on past 300 tokens
POINTS = ("head", "body", "sent", "events", "wait")


@pytest.fixture
def recorded(smollm, monkeypatch):
    """A worker whose engine records each generation: tokens streamed and how it ended."""
    with chat_worker(smollm, max_tokens=4) as worker:
        eng, records = worker.engine, []
        chat = eng.chat

        def recording(*args, **kwargs):
            rec = {"tokens": 0, "finish": None}
            records.append(rec)
            for ev in chat(*args, **kwargs):
                if ev["type"] == "token":
                    rec["tokens"] += 1
                elif ev["type"] == "done":
                    rec["finish"] = ev["finish_reason"]
                yield ev

        monkeypatch.setattr(eng, "chat", recording)
        yield worker, records


def request(port, stream):
    body = json.dumps({"messages": user(STORY), "max_tokens": LONG, "temperature": 0, "stream": stream}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
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
            if point == "events":  # read a few SSE data lines (the role chunk, then tokens), then leave
                seen, buf = 0, b""
                while seen < plan["events"] and (chunk := s.recv(4096)):
                    buf += chunk
                    seen = buf.count(b"\ndata: ")
            elif point == "wait":
                time.sleep(plan["delay"])
    finally:
        s.close()
        done.append(plan)


def test_twenty_clients_hang_up_at_random_points(recorded, tmp_path):
    worker, records = recorded
    rng = random.Random(12)
    plans = [{"point": rng.choice(POINTS), "stream": rng.random() < 0.6, "reset": rng.random() < 0.3,
              "cut": rng.randrange(1, 10**6), "events": rng.randint(1, 5), "delay": rng.uniform(0, 1.5)}
             for _ in range(CLIENTS)]
    for p in plans:
        p["stream"] |= p["point"] == "events"  # a whole reply (no stream) has no events to read
    with serve(create_app(worker, tmp_path)) as url:
        port = int(url.rsplit(":", 1)[1])
        reference = post(url + "/v1/chat/completions", {"messages": user("Hi"), "max_tokens": 3, "temperature": 0})
        assert reference.status_code == 200
        records.clear()

        start, done = threading.Barrier(CLIENTS), []
        threads = [threading.Thread(target=client, args=(port, p, start, done)) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert len(done) == CLIENTS, "a client could not hang up"

        # Every generation a client started ends, cancelled, long before its max_tokens.
        wait_for(lambda: worker.busy() == 0, "the worker to be idle again")
        complete = sum(p["point"] in ("sent", "events", "wait") for p in plans)
        assert len(records) <= complete
        assert all(r["finish"] == "cancelled" and r["tokens"] < LONG for r in records), (records, plans)
        eng = worker.engine
        assert eng.cache[0].offset == len(eng.tokens)  # the cache holds exactly what the engine thinks

        again = post(url + "/v1/chat/completions", {"messages": user("Hi"), "max_tokens": 3, "temperature": 0})
        assert again.status_code == 200
        assert again.json()["choices"] == reference.json()["choices"]
        assert records[-1]["finish"] in ("stop", "length")
        print(f"{len(records) - 1} generations started and cancelled; tokens each:", [r["tokens"] for r in records[:-1]])
