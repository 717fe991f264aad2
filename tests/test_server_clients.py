"""Real OpenAI clients against python -m kvarn_mlx.server, on a machine with no
Hugging Face cache folder (HF_HOME is an empty temporary folder): the `openai`
Python client and the `llm` command-line tool, started as their users start
them. One server process for the module: a tiny random-weight llama with the
embedded model's tokenizer (tests/model_folder.py).

The random model's replies are arbitrary text; a logit bias on token 33 ("1" in
SmolLM2's tokenizer, which splits numbers into digits) makes them "111...",
which stop words and the llm test can check.
"""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from model_folder import tiny_model_folder
from server_process import free_port, running
from test_server_mlx import TIMEOUT, get

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
ONES = {"33": 100}  # logit_bias: the reply is "1" repeated
USER = [{"role": "user", "content": "Count with me."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, the id /v1/models lists, the log's path) of one server."""
    tmp = tmp_path_factory.mktemp("clients")
    model = tiny_model_folder(tmp / "model")
    port = free_port()
    env = {
        **os.environ,
        "HF_HOME": str(tmp / "no-hf-home"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("KVARN_API_KEY", None)
    log = tmp / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "kvarn_mlx.server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--kv-preset",
        "k4v2_g64",
        "--kv-sink",
        "16",
        "--max-tokens",
        "16",
    ]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out, running(cmd, url, out, env=env):
        yield url, str(model), log
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def test_models_list_names_the_served_model_without_a_hub_cache(served, client):
    url, model_id, log = served
    assert [m.id for m in client.models.list()] == [model_id]
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("someone/not-here")
    assert e.value.body["code"] == "model_not_found"
    assert "Traceback" not in log.read_text() and "CacheNotFound" not in log.read_text()


def test_model_names_that_are_served(client, served):
    model_id = served[1]
    for name in (model_id, "default_model", os.path.realpath(model_id)):
        r = client.chat.completions.create(model=name, messages=USER, max_tokens=3, logit_bias=ONES)
        assert r.choices[0].message.content == "111" and r.model == name
    with pytest.raises(openai.NotFoundError) as e:  # not a folder, not in the (absent) hub cache
        client.chat.completions.create(model="default", messages=USER, max_tokens=3)
    assert (
        e.value.status_code == 404
        and e.value.body["param"] == "model"
        and model_id in e.value.body["message"]
    )
    # no "model" at all: the served one (the openai client requires the field; a raw request)
    body = json.dumps({"messages": USER, "max_tokens": 2, "logit_bias": ONES}).encode()
    req = urllib.request.Request(
        served[0] + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        reply = json.loads(r.read())
    assert reply["choices"][0]["message"]["content"] == "11" and reply["model"] == model_id


def test_chat_and_text_completions_whole_and_streamed(client, served):
    model_id = served[1]
    r = client.chat.completions.create(model=model_id, messages=USER, max_tokens=4, logit_bias=ONES)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=USER,
            max_tokens=4,
            logit_bias=ONES,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "1111"
    assert chunks[-1].usage.completion_tokens == 4
    t = client.completions.create(model=model_id, prompt="Once upon", max_tokens=5, logit_bias=ONES)
    assert t.choices[0].text == "11111" and t.usage.completion_tokens == 5
    streamed = client.completions.create(
        model=model_id, prompt="Once upon", max_tokens=5, logit_bias=ONES, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "11111"


def test_stop_max_tokens_logprobs_and_tools(client, served):
    model_id = served[1]
    r = client.chat.completions.create(
        model=model_id, messages=USER, max_tokens=12, logit_bias=ONES, stop=["111"]
    )
    # the third "1" completes the stop word: three tokens, the stop word left out of the text
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    assert not r.choices[0].message.content
    r = client.chat.completions.create(
        model=model_id, messages=USER, max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "clock",
                "description": "the time now",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    r = client.chat.completions.create(
        model=model_id, messages=USER, max_tokens=3, tools=tools, logit_bias=ONES
    )
    assert r.choices[0].message.content == "111"


def test_bad_values_are_400s_naming_the_field(client, served):
    url, model_id, _ = served
    for fields, name in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"extra_body": {"stream_options": "yes"}}, "stream_options"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"extra_body": {"top_k": "5"}}, "top_k"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_id, messages=USER, **fields)
        assert e.value.body["param"] == name and name in e.value.body["message"], e.value.body
    # the openai client sends no NaN or infinity; Python's json module does
    for name, value in [("temperature", "NaN"), ("top_p", "Infinity"), ("min_p", "-Infinity")]:
        body = f'{{"messages": {json.dumps(USER)}, "{name}": {value}}}'.encode()
        for path in ("/v1/chat/completions", "/v1/completions"):
            req = urllib.request.Request(
                url + path, data=body, headers={"Content-Type": "application/json"}
            )
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=TIMEOUT)
            error = json.loads(e.value.read())["error"]
            assert e.value.code == 400 and error["param"] == name, error


def test_a_client_that_leaves_mid_stream_stops_its_generation(client, served):
    url, model_id, _ = served
    stream = client.chat.completions.create(
        model=model_id, messages=USER, max_tokens=100_000, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + TIMEOUT
    while get(url + "/v1/kv_stats")["live"]["sequences"]:
        assert time.monotonic() < deadline, "the abandoned generation never stopped"
        time.sleep(0.1)
    r = client.chat.completions.create(model=model_id, messages=USER, max_tokens=2, logit_bias=ONES)
    assert r.choices[0].message.content == "11"


def test_the_llm_command_line_tool(served, tmp_path):
    """llm with an OpenAI-compatible model entry (extra-openai-models.yaml in
    LLM_USER_PATH), its console script run from another folder."""
    url, model_id, _ = served
    llm = Path(sys.executable).parent / "llm"
    if not llm.exists():
        pytest.fail("the llm command is missing: pip install -e '.[test]' installs it")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: kvarn\n  model_name: {json.dumps(model_id)}\n  api_base: "
        f"{json.dumps(url + '/v1')}\n"
    )
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path)}
    env.pop("OPENAI_API_KEY", None)
    run = lambda *a: subprocess.run(
        [str(llm), *a],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,  # noqa: E731
        timeout=TIMEOUT,
    )
    ask = (
        "-m",
        "kvarn",
        "Count with me.",
        "-o",
        "max_tokens",
        "4",
        "-o",
        "logit_bias",
        json.dumps(ONES),
    )
    streamed, whole = run(*ask), run(*ask, "--no-stream")
    assert (streamed.returncode, streamed.stdout.strip()) == (0, "1111"), streamed.stderr
    assert (whole.returncode, whole.stdout.strip()) == (0, "1111"), whole.stderr
    logged = json.loads(run("logs", "-n", "2", "--json").stdout)  # oldest first
    assert [e["response_json"]["object"] for e in logged] == [
        "chat.completion.chunk",
        "chat.completion",
    ]
