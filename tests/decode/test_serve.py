"""decode/serve.py through the real `openai` client on 127.0.0.1: greedy output token-identical
to decode/evaluate.py's, seeded sampling reproducible, streaming (SSE, usage), n, stop strings,
the bounded queue (429), a disconnecting client freeing the engine, timeouts, /metrics, and a
400 naming the field for every kind of bad input, after which the server keeps serving."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from draftsmith.decode.probe import write_probe
from draftsmith.decode import serve
from draftsmith.decode.serve import Server as Serving
from draftsmith.decode.serve import TextStream, make_app
from draftsmith.models.checkpoint import save_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.verifier import fingerprint
from tests.hub import free_port  # a port per launch: fixed ones collide between xdist workers
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config
from tests.tiny import tiny_llama

openai = pytest.importorskip("openai")
MESSAGES = [{"role": "user", "content": "Tell me about cats."}]


@pytest.fixture(scope="module")
def drafter(tiny_model_dir, tmp_path_factory):
    model = tiny_llama(dtype=torch.float32)
    cfg = MedusaConfig(hidden_size=32, vocab_size=128, num_heads=2)
    heads = MedusaHeads(cfg, model.get_output_embeddings())
    torch.manual_seed(1)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.05)
    path = save_drafter(tmp_path_factory.mktemp("d") / "heads", "medusa", heads, cfg,
                        verifier_fingerprint=fingerprint(model), verifier_name="tiny")
    write_probe(path, {"prompts": [[5, 6]], "max_new_tokens": 4, "decode": {"name": "chain4"}, "dtype": "torch.float32",
                       "tau": 1.5})
    return path


def serve_cfg(tiny_model_dir, drafter, *extra):
    return compose_config("serve", tiny_model_overrides(tiny_model_dir) + [
        "proposer=medusa", f"drafter={drafter}", "decode=chain4", "decode.paths=[[0],[0,0]]", "threads=1", *extra])


class Server:
    """make_app's app under uvicorn in a thread, on a free port; `client` sends `api_key`."""

    def __init__(self, cfg, api_key: str = "none"):
        self.engine = Serving(cfg)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.engine, cfg), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tiny_model_dir, drafter):
    s = Server(serve_cfg(tiny_model_dir, drafter))
    yield s
    s.stop()


def test_greedy_is_token_identical_to_evaluate_streaming_and_not(server, tiny_model_dir, drafter, tmp_path):
    from draftsmith.decode.evaluate import run as evaluate
    from draftsmith.models.sources import load_prompts

    cfg = compose_config("evaluate", tiny_model_overrides(tiny_model_dir) + [
        "proposer=medusa", f"drafter={drafter}", "decode=chain4", "decode.paths=[[0],[0,0]]", "data=tiny",
        "data.num_prompts=2", "max_new_tokens=24", "hf.enabled=false", f"output_dir={tmp_path}"])
    evaluate(cfg)
    offline = [json.loads(line) for line in open(tmp_path / "outputs.jsonl") if '"method": "medusa"' in line]
    tok = server.engine.tokenizer
    for prompt, record in zip(load_prompts(cfg.data), offline):
        expected = tok.decode(record["tokens"], skip_special_tokens=True)
        reply = server.client.chat.completions.create(model="tiny", messages=prompt["messages"], max_tokens=24,
                                                      temperature=0)
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens == len(record["tokens"])
        assert reply.usage.prompt_tokens == len(record["prompt_ids"])
        chunks = list(server.client.chat.completions.create(
            model="tiny", messages=prompt["messages"], max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == len(record["tokens"]) and not chunks[-1].choices
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # tokens arrive as accepted


def test_completions_seeded_sampling_n_and_stop(server):
    c = server.client
    a = c.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=0.8, seed=5, n=2)
    b = c.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=0.8, seed=5, n=2)
    assert [x.text for x in a.choices] == [x.text for x in b.choices] and len(a.choices) == 2
    other = c.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=0.8, seed=6, n=2)
    assert [x.text for x in other.choices] != [x.text for x in a.choices]
    streamed = ["".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, temperature=0.8, seed=5, stream=True) if ch.choices)
        for _ in range(2)]
    whole = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0.8, seed=5)
    assert streamed[0] == streamed[1] == whole.choices[0].message.content  # seeded: the same, streamed or not
    full = c.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=0).choices[0].text
    stop = next(ch for ch in full[3:] if ch.strip())  # a character the greedy text goes on to write
    cut = c.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop, 0)] and cut.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=0, stop=[stop],
                                    stream=True)
    assert "".join(x.choices[0].text for x in streamed if x.choices) == cut.choices[0].text


def test_text_stream_never_cuts_a_character_or_leaks_a_stop_string():
    class Bytes:  # token i = byte i; decode as UTF-8 with replacement (as byte-level BPE tokenizers do)
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    text = "naïve café — ok STOP tail"
    data = list(text.encode())
    stream, pieces = TextStream(Bytes(), ["STOP"]), []
    for b in data:
        pieces.append(stream.push([b]))
    pieces.append(stream.finish())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "naïve café — ok "
    assert not any("S" in p for p in pieces)  # "STOP" was held back, never sent



def trained_tokenizer(kind: str):
    """A small trained tokenizer: byte-level BPE (SmolLM2's and GPT-2's kind: one character may span
    tokens) or Metaspace (Llama-2's SentencePiece kind: a text's first space is dropped)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["naïve café — déjà vu, 東京 and 🙂 emoji; the cat sat on the mat. " * 3, "ok STOP tail, über straße"]
    tok = Tokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace" else None))
    if kind == "byte-level":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok), corpus


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_text_stream_pieces_join_to_the_whole_decode_and_each_push_decodes_a_few_tokens(kind):
    """Streamed in pushes of 1-3 tokens, the pieces join to decode(all tokens), stop strings held
    back and cut as the whole text would cut them; and while the text is well-formed, no push
    decodes more than a few tokens: its own, the last decoded ones, a character's split bytes (never
    the whole text per token; random tokens may hold invalid bytes, which wait for more)."""
    tokenizer, corpus = trained_tokenizer(kind)
    lengths = []
    decode = tokenizer.decode
    tokenizer.decode = lambda ids, **kw: (lengths.append(len(ids)), decode(ids, **kw))[1]
    g = torch.Generator().manual_seed(0)
    text_ids = tokenizer(" ".join(corpus) * 4)["input_ids"]
    ids = text_ids + torch.randint(0, len(tokenizer), (200,), generator=g).tolist()  # odd bytes and all
    whole = decode(ids, skip_special_tokens=True)
    for stop in ([], ["STOP"], ["straße", "🙂"]):
        stream, pieces, at = TextStream(tokenizer, stop), [], 0
        lengths.clear()
        while at < len(ids):
            if at >= len(text_ids) and lengths:
                assert len(text_ids) > 150 and max(lengths) <= 24, max(lengths)  # a text of 200-400 tokens
                lengths.clear()
            n = 1 + int(torch.randint(0, 3, (), generator=g))
            pieces.append(stream.push(ids[at:at + n]))
            at += n
        pieces.append(stream.finish())
        cuts = [whole.find(s) for s in stop if s in whole]
        assert "".join(pieces) == (whole[:min(cuts)] if cuts else whole)


BAD = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', None),
    ("unknown model", {"model": "gpt-9", "messages": MESSAGES}, "model"),
    ("negative max_tokens", {"model": "tiny", "messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
    ("absurd max_tokens", {"model": "tiny", "messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
    ("negative temperature", {"model": "tiny", "messages": MESSAGES, "temperature": -0.5}, "temperature"),
    ("top_p 0", {"model": "tiny", "messages": MESSAGES, "top_p": 0}, "top_p"),
    ("top_p above 1", {"model": "tiny", "messages": MESSAGES, "top_p": 1.5}, "top_p"),
    ("oversized prompt", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
    ("wrong type", {"model": "tiny", "messages": MESSAGES, "max_tokens": "12"}, "max_tokens"),
    ("wrong type in a message", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ("unknown field", {"model": "tiny", "messages": MESSAGES, "frequency_penalty_x": 1}, "frequency_penalty_x"),
    ("unknown role", {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_400_naming_the_field(server, name, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (name, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert "\n" not in error["message"]
    ok = server.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert ok.choices[0].message.content is not None  # ... and the server keeps serving


def test_models_health_and_metrics(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["verifier_fingerprint"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    server.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["draftsmith:spec_decode_num_drafts_total"] > 0
    drafts = values["draftsmith:spec_decode_num_drafts_total"]  # (engine.budget=adaptive may cut a chain of 2 to 1)
    assert drafts <= values["draftsmith:spec_decode_num_draft_tokens_total"] <= 2 * drafts
    assert values['draftsmith:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] >= \
        values['draftsmith:spec_decode_num_accepted_tokens_per_pos_total{position="1"}']
    steps = values["draftsmith:verification_steps_total"]
    assert values["draftsmith:spec_decode_mean_acceptance_length"] == pytest.approx(
        (values["draftsmith:spec_decode_num_accepted_tokens_total"] + steps) / steps)
    assert values["draftsmith:drafter_probe_tau"] == 1.5  # the baseline recorded with the drafter


def test_a_full_queue_answers_429_and_a_gone_client_frees_the_engine(tiny_model_dir, drafter):
    s = Server(serve_cfg(tiny_model_dir, drafter, "max_queue=1", "request_timeout_s=1.5"))
    try:
        gate = threading.Event()
        step = s.engine.engine.step
        s.engine.engine.step = lambda: (gate.wait(30), step())[1]  # the engine holds its first step
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "temperature": 0}
        held = threading.Thread(target=lambda: httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=30))
        held.start()
        while not s.engine.busy:
            time.sleep(0.01)
        queued = threading.Thread(target=lambda: httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=30))
        queued.start()
        while s.engine.jobs.qsize() < 1:
            time.sleep(0.01)
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        gate.set()
        held.join()
        queued.join()
        s.engine.engine.step = step
        # a streaming client that goes away mid-stream: the engine stops at its next step
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", timeout=30,
                          json={**body, "max_tokens": 4000, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    break
        t0 = time.time()
        while s.engine.busy and time.time() - t0 < 10:
            time.sleep(0.01)
        assert not s.engine.busy
        values = httpx.get(f"{s.url}/metrics").text
        assert "draftsmith:requests_cancelled_total 1" in values
        # a request past request_timeout_s is cancelled: 504 with an OpenAI-style error
        s.engine.engine.step = lambda: (time.sleep(1.6), step())[1]
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    finally:
        s.stop()


def test_a_draft_model_served_as_draft_cpu(tiny_model_dir, server, tmp_path):
    """decode=draft-cpu behind the server (an int8 copy of the draft, its top-2 at depth 1,
    prompt lookup grafted onto greedy requests): greedy replies are the Medusa server's, i.e.
    the verifier's own greedy text; sampled requests (the graft off) are seeded."""
    from omegaconf import OmegaConf

    from draftsmith.models.draft import build_student, save_draft_model
    from tests.tiny import tiny_tokenizer

    verifier = tiny_llama(dtype=torch.float32)
    student = build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 1}))
    path = save_draft_model(tmp_path / "draft", student, tiny_tokenizer(), verifier_fingerprint=fingerprint(verifier),
                            verifier_name="tiny", draft_vocab=torch.arange(0, 128, 2))
    s = Server(compose_config("serve", tiny_model_overrides(tiny_model_dir) + [
        "proposer=draft", f"drafter={path}", "decode=draft-cpu", "threads=1"]))
    try:
        draft = s.engine.proposer.inner
        assert (draft.quant, draft.widths, draft.length, s.engine.proposer.num_tokens) == ("int8", [2], 1, 10)
        for prompt in ("hello", "the cat sat on the mat, the cat sat"):
            want = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
            got = s.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
            assert got.choices[0].text == want.choices[0].text and got.usage == want.usage
        sampled = [s.client.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=0.8,
                                               seed=5).choices[0].text for _ in range(2)]
        assert sampled[0] == sampled[1]
    finally:
        s.stop()


# ------------------------------------------------------------------ who may call the server

KEY = "sk-test-9f3c0e1d"


def test_an_api_key_admits_the_right_key_only(tiny_model_dir, drafter, monkeypatch):
    """The real openai client with the right key, a wrong key and no key at all; /health stays
    open, /metrics needs the key unless open_metrics=true. The key comes from the environment here
    and from api_key= in the next server (the config wins over the environment)."""
    monkeypatch.setenv(serve.API_KEY_ENV, KEY)
    s = Server(serve_cfg(tiny_model_dir, drafter), api_key=KEY)
    try:
        ok = s.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
        assert ok.choices[0].message.content is not None
        streamed = list(s.client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0,
                                                    stream=True))
        assert streamed and all(c.object == "text_completion" for c in streamed)
        wrong = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-wrong", max_retries=0)
        for client, headers, why in [(wrong, None, "incorrect API key"),
                                     (s.client, {"Authorization": openai.omit}, "needs an API key")]:
            for call in (lambda: client.models.list(extra_headers=headers),
                         lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                                extra_headers=headers),
                         lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=4, stream=True,
                                                           extra_headers=headers)):
                with pytest.raises(openai.AuthenticationError) as refused:
                    call()
                assert refused.value.status_code == 401
                error = refused.value.body
                assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error", error
                assert why in error["message"] and KEY not in refused.value.response.text
        assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": KEY}).status_code == 401  # no "Bearer"
        assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        assert httpx.get(f"{s.url}/docs").status_code == 401  # every route but the open ones
        assert httpx.get(f"{s.url}/health").json()["status"] == "ok"  # liveness probes carry no key
        assert httpx.get(f"{s.url}/metrics").status_code == 401
        metrics = httpx.get(f"{s.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert "draftsmith:requests_total 2" in metrics.text  # the refused requests never reached the engine
    finally:
        s.stop()
    s = Server(serve_cfg(tiny_model_dir, drafter, "api_key=from-config", "open_metrics=true"), api_key="from-config")
    try:
        assert s.client.models.list().data[0].id == "tiny"
        with pytest.raises(openai.AuthenticationError):  # the environment's key is not the server's now
            openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0).models.list()
        assert httpx.get(f"{s.url}/metrics").status_code == 200 and httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("setting, env, message", [
    (["api_key=''"], None, "api_key is set but empty"),
    ([], "", "$DRAFTSMITH_API_KEY is set but empty"),
    (["api_key=12345"], None, "api_key must be text, not a int: quote it"),
    (["api_key='two words'"], None, "api_key holds a space"),
    ([], "caf\u00e9-key", "$DRAFTSMITH_API_KEY holds a space, a control or a non-ASCII character"),
    (["open_metrics=true"], None, "open_metrics=true would be ignored: without an API key"),
])
def test_a_key_setting_that_cannot_work_is_refused_before_loading(tiny_model_dir, drafter, monkeypatch, setting, env,
                                                                  message):
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(serve.API_KEY_ENV, env)
    cfg = serve_cfg(tiny_model_dir, drafter, *setting)
    monkeypatch.setattr(serve, "Engine", lambda cfg: pytest.fail("the verifier loaded"))
    with pytest.raises(DraftsmithError) as refused:
        serve.run(cfg)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert "12345" not in str(refused.value) and "words" not in str(refused.value)  # the key is never shown


def test_api_key_argument_leaves_argv_before_hydra_sees_it():
    environ = {}
    argv = serve.take_api_key_argument(["proposer=vanilla", "api_key=12345,a=b$x", "port=1"], environ)
    assert argv == ["proposer=vanilla", "port=1"] and environ[serve.API_KEY_ENV] == "12345,a=b$x"  # as typed
    assert serve.take_api_key_argument(["api_key='0123'"], environ) == [] and environ[serve.API_KEY_ENV] == "0123"
    environ = {}
    assert serve.take_api_key_argument(["api_key=null", "host=0.0.0.0"], environ) == ["host=0.0.0.0"]
    assert environ == {}


def test_bearer_matches_only_the_key():
    key = b"sk-abc"
    assert serve.bearer_matches(b"Bearer sk-abc", key) and serve.bearer_matches(b"bearer  sk-abc ", key)
    for header in (None, b"", b"sk-abc", b"Basic sk-abc", b"Bearer sk-ab", b"Bearer sk-abcd", b"Bearer "):
        assert not serve.bearer_matches(header, key), header


def test_exposure_warning_only_beyond_loopback_without_a_key():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert serve.exposure_warning(host, 8000, None) is None, host
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        line = serve.exposure_warning(host, 8000, None)
        assert line.startswith(f"draftsmith serve: warning: host={host} listens beyond this machine")
        assert "\n" not in line
        assert serve.exposure_warning(host, 8000, KEY) is None


def test_start_warns_in_one_line_beyond_loopback_without_a_key(tiny_model_dir, drafter, monkeypatch, capsys):
    """run(cfg) up to uvicorn (not started here: nothing binds 0.0.0.0 in a test): one warning line
    on stderr without a key, none with one; the start line says who may call."""
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    monkeypatch.setattr(serve, "serve_forever", lambda engine, app, cfg: None)
    serve.run(serve_cfg(tiny_model_dir, drafter, "host=0.0.0.0"))
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "warning" in line] == [serve.exposure_warning("0.0.0.0", 8000, None)]
    assert out.strip().endswith("; no API key")
    serve.run(serve_cfg(tiny_model_dir, drafter, "host=0.0.0.0", f"api_key={KEY}"))
    out, err = capsys.readouterr()
    assert "warning" not in err and out.strip().endswith("; API key required (except /health)") and KEY not in out + err


def test_serve_entry_never_logs_the_key(tiny_model_dir):
    """The script as users run it (Hydra, uvicorn's access log on), the key on its command line:
    after a request without it, one with a wrong key and one with it, the key is in no output. The
    key holds what Hydra's grammar refuses (`,` and `=`: its error would print the key); it must reach
    the server as typed."""
    key = "0123,sk-test=9f3c"
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != serve.API_KEY_ENV}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "decode/serve.py", *tiny_model_overrides(tiny_model_dir), "threads=1",
                             f"port={port}", f"api_key={key}", "log_level=info"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, t0, codes = f"http://127.0.0.1:{port}", time.time(), []
        while time.time() - t0 < 120:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Bearer {key}"}):
            codes.append(httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                                    json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code)
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert codes == [401, 401, 200], output
    assert "API key required (except /health)" in output and "POST /v1/completions" in output  # the access log ran
    assert key not in output


def test_the_script_steps_the_engine_in_the_main_thread_and_a_port_taken_ends_it_in_one_line(tiny_model_dir, drafter):
    """serve_forever: the engine loop runs in the calling (main) thread, uvicorn in a thread; when
    uvicorn cannot bind its port the loop ends and the run stops in one line naming the port."""
    import socket

    cfg = serve_cfg(tiny_model_dir, drafter, f"port={free_port()}")
    engine = serve.Server(cfg, thread=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(cfg.port)))
        taken.listen()
        with pytest.raises(DraftsmithError, match=rf"^the HTTP server did not start on 127.0.0.1:{cfg.port} "):
            serve.serve_forever(engine, make_app(engine, cfg), cfg)
    assert engine.stopping.is_set() and threading.current_thread() is threading.main_thread()


@pytest.mark.parametrize("config, method", [("serve", ["proposer=vanilla"]),
                                            ("serve", ["proposer=lookahead", "decode=lookahead"]),
                                            ("evaluate", ["proposer=prompt-lookup", "decode=prompt-lookup"])])
def test_a_drafter_the_proposer_would_ignore_is_refused(tiny_model_dir, drafter, config, method):
    from draftsmith.decode.build import check_drafter
    from tests.hub import compose_config

    cfg = compose_config(config, tiny_model_overrides(tiny_model_dir) + [*method, f"drafter={drafter}"])
    with pytest.raises(DraftsmithError, match=rf"^drafter={drafter} would be ignored: proposer=\S+ decodes without"):
        Serving(cfg) if config == "serve" else check_drafter(cfg)
    # ... while a config's own default drafter (evaluate.yaml's interpolation) and drafter=null are no request
    assert check_drafter(compose_config(config, tiny_model_overrides(tiny_model_dir) + method)) != "medusa"
    assert check_drafter(compose_config(config, tiny_model_overrides(tiny_model_dir) + [*method, "drafter=null"]))


# ------------------------------------------------------------------ continuous batching


def test_concurrent_requests_share_steps_and_each_is_its_own_greedy_reply(tiny_model_dir, drafter):
    """Six clients at once: every reply is the reply it gets alone; the engine ran them together
    (fewer engine steps than tokens, a batch of several rows in /metrics); a seeded sampled reply
    is the same alone and among the others."""
    s = Server(serve_cfg(tiny_model_dir, drafter, "engine.max_num_seqs=4", "engine.prefill_chunk=16"))
    try:
        prompts = [f"question number {i} about {'cats' * (i + 1)}" for i in range(6)]

        def ask(prompt, **kw):
            return s.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, **kw).choices[0].text

        alone = [ask(p, temperature=0) for p in prompts]
        seeded = ask(prompts[0], temperature=0.9, seed=11)
        before = httpx.get(f"{s.url}/metrics").text
        steps0 = float(next(line.split()[1] for line in before.splitlines() if line.startswith("draftsmith:engine_steps_total")))
        replies, widest = [None] * 7, []
        def worker(i):
            replies[i] = ask(prompts[i], temperature=0) if i < 6 else ask(prompts[0], temperature=0.9, seed=11)

        def watch():
            while any(r is None for r in replies):
                text = httpx.get(f"{s.url}/metrics").text
                widest.append(int(float(next(line.split()[1] for line in text.splitlines()
                                             if line.startswith("draftsmith:batch_rows ")))))
                time.sleep(0.005)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(7)] + [threading.Thread(target=watch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert replies[:6] == alone and replies[6] == seeded
        after = httpx.get(f"{s.url}/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in after.splitlines() if line and line[0] != "#"}
        assert max(widest) > 1 and max(widest) <= 4  # rows decoded together, never more than max_num_seqs
        assert values["draftsmith:prompt_tokens_beside_decoding_total"] > 0  # prompts read in decoding rows' forwards
        assert values["draftsmith:engine_steps_total"] - steps0 < 6 * 24  # steps were shared
        assert any(k.startswith("draftsmith:engine_steps_by_width_total") for k in values)
    finally:
        s.stop()


def test_a_kv_cache_that_cannot_fit_is_refused_before_serving(tiny_model_dir, drafter):
    with pytest.raises(DraftsmithError, match=r"^engine.max_num_seqs=100000000 rows x \d+ slots .* need [\d.]+ GB of KV "
                                              r"cache and [\d.]+ GB are free: lower engine.max_num_seqs"):
        Serving(serve_cfg(tiny_model_dir, drafter, "engine.max_num_seqs=100000000"))


def test_engine_compile_reaches_the_servers_engine(tiny_model_dir, drafter):
    """engine.compile=count: the server's step runs as captured graphs (counted), and its reply is
    the uncompiled server's; an unknown compiler is refused in one line naming the key."""
    from draftsmith.decode.forward import compiled
    from draftsmith.models.errors import DraftsmithError

    replies = []
    for mode in ("none", "count"):
        before = compiled.graphs
        s = Server(serve_cfg(tiny_model_dir, drafter, "engine.forward=fast", f"engine.compile={mode}"))
        try:
            replies.append(s.client.completions.create(model="tiny", prompt="tell me about cats", max_tokens=12,
                                                       temperature=0).choices[0].text)
        finally:
            s.stop()
        assert (compiled.graphs > before) == (mode == "count")
    assert replies[0] == replies[1]
    with pytest.raises(DraftsmithError, match="engine.compile"):
        Serving(serve_cfg(tiny_model_dir, drafter, "engine.compile=tensorrt"))
