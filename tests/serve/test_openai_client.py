#!/usr/bin/env python3
"""`tpmoe serve` against the official OpenAI Python client (PyPI `openai`, tests only).

Starts `tpmoe serve --preset tiny --device cpu --port 0` and checks what issue 13 asks of it: a
streamed chat completion, a seeded sampled completion that repeats, 64 concurrent greedy
completions each equal to the same request alone, a client that leaves mid-stream whose KV pages
return to the pool (/metrics), bad requests answered with a 4xx while the server stays up, and a
clean stop on SIGINT.

Exits 77 (ctest's SKIP_RETURN_CODE) when the `openai` package is not importable.
    python3 tests/serve/test_openai_client.py --tpmoe build-cpu/tpmoe
"""
import argparse
import json
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request

SKIPPED = 77
try:
    import openai
except ImportError:
    print("skipped: the python package 'openai' is not installed (pip install openai)")
    sys.exit(SKIPPED)

TPMOE = None  # the tpmoe binary, from the command line
STARTUP_SECONDS = 120


class Server:
    """A `tpmoe serve` process on a free port; its output is kept for failure messages."""

    def __init__(self, args):
        self.proc = subprocess.Popen([TPMOE, "serve", *args, "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines = []
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"listening on (http://[^\s]+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()  # the process ended

        threading.Thread(target=read, daemon=True).start()
        ready.wait(STARTUP_SECONDS)
        if not self.url:
            self.proc.kill()
            raise RuntimeError("tpmoe serve did not start listening:\n" + self.output())
        self.model = re.search(r"model '([^']+)'", "".join(self.lines)).group(1)

    def output(self):
        return "".join(self.lines)

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.status, r.read().decode()

    def post_raw(self, path, data: bytes):
        """(status, body) of a POST with `data` as the body, errors included."""
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self):
        status, text = self.get("/metrics")
        assert status == 200
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


class OpenAIClientAgainstTpmoeServe(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(["--preset", "tiny", "--device", "cpu"])
        cls.client = openai.OpenAI(base_url=cls.server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        cls.model = cls.server.model
        card = json.loads(cls.server.get("/v1/models")[1])["data"][0]
        cls.max_context = card["max_model_len"]

    @classmethod
    def tearDownClass(cls):
        code = cls.server.stop()
        assert code == 0, f"tpmoe serve exited {code} on SIGINT:\n{cls.server.output()}"
        assert "stopped" in cls.server.output(), cls.server.output()

    def assert_healthy(self):
        self.assertEqual(self.server.get("/health")[0], 200, "the server stopped answering")

    def test_streamed_chat_completion(self):
        stream = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=24,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        pieces, finish, usage, roles = [], None, None, []
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            self.assertEqual(chunk.object, "chat.completion.chunk")
            delta = chunk.choices[0].delta
            if delta.role:
                roles.append(delta.role)
            extra = delta.model_extra or {}
            text = (delta.content or "") + (extra.get("reasoning_content") or "")
            if text:
                pieces.append(text)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        self.assertEqual(roles, ["assistant"])
        self.assertGreater(len(pieces), 2, "the reply did not arrive in several chunks")
        self.assertEqual(finish, "length")
        self.assertIsNotNone(usage, "no usage chunk with include_usage")
        self.assertEqual(usage.completion_tokens, 24)
        self.assertGreater(usage.prompt_tokens, 0)
        self.assertEqual(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)

    def test_chat_completion_not_streamed(self):
        r = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, temperature=0)
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertLessEqual(r.usage.completion_tokens, 8)

    def test_sampled_completion_repeats_with_its_seed(self):
        def sample(seed):
            r = self.client.completions.create(model=self.model, prompt="Once upon a time", max_tokens=16,
                                               temperature=0.8, seed=seed, extra_body={"ignore_eos": True})
            self.assertEqual(r.usage.completion_tokens, 16)
            return r.choices[0].text

        first = sample(1234)
        self.assertEqual(sample(1234), first)

    def test_64_concurrent_greedy_completions_match_each_alone(self):
        prompts = [f"Request {i}: " + "and then " * (i % 7) for i in range(64)]

        def complete(prompt):
            r = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
            return r.choices[0].text, r.usage.completion_tokens

        alone = [complete(p) for p in prompts]
        together = [None] * len(prompts)
        errors = []

        def run(i):
            try:
                together[i] = complete(prompts[i])
            except Exception as e:  # reported below, with the request's index
                errors.append(f"request {i}: {e!r}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        for i, (a, b) in enumerate(zip(alone, together)):
            self.assertEqual(b, a, f"request {i} differs when served with 63 others")
            self.assertEqual(a[1], 12)

    def test_client_gone_mid_stream_frees_its_pages(self):
        before = self.server.metrics()["tpmoe_requests_aborted_total"]
        stream = self.client.completions.create(model=self.model, prompt="A long story:", stream=True,
                                                temperature=0, extra_body={"ignore_eos": True})
        for n, _ in enumerate(stream):
            if n == 3:
                break
        stream.close()  # the client leaves; max_tokens was the rest of the context, far from done
        deadline = time.time() + 60
        while True:
            m = self.server.metrics()
            if m["tpmoe_kv_pages_used"] == 0 and m["tpmoe_requests_aborted_total"] == before + 1:
                break
            self.assertLess(time.time(), deadline,
                            f"pages used {m['tpmoe_kv_pages_used']}, aborted {m['tpmoe_requests_aborted_total']} "
                            f"(was {before}) a minute after the client left")
            time.sleep(0.1)
        self.assertEqual(m["tpmoe_requests_running"], 0)
        self.assert_healthy()

    def assert_refused(self, error_class, status, **kwargs):
        with self.assertRaises(error_class) as caught:
            self.client.completions.create(**{"model": self.model, "prompt": "x", **kwargs})
        self.assertEqual(caught.exception.status_code, status)
        body = caught.exception.body
        self.assertTrue(body and body.get("message"), f"no message: {caught.exception!r}")
        self.assert_healthy()
        return body

    def test_bad_requests_get_4xx_and_the_server_stays_up(self):
        status, body = self.server.post_raw("/v1/completions", b'{"model": "tiny", "prompt": ')
        self.assertEqual(status, 400, body)
        self.assertIn("JSON", json.loads(body)["error"]["message"])
        self.assert_healthy()

        body = self.assert_refused(openai.NotFoundError, 404, model="no-such-model")
        self.assertIn("no-such-model", body["message"])
        body = self.assert_refused(openai.BadRequestError, 400, prompt=[1] * self.max_context)
        self.assertIn("context", body["message"])
        self.assert_refused(openai.BadRequestError, 400, max_tokens=self.max_context)
        for bad in (0, -1):
            self.assert_refused(openai.BadRequestError, 400, max_tokens=bad)
        body = self.assert_refused(openai.BadRequestError, 400, temperature=-1)
        self.assertIn("temperature", body["message"])
        self.assert_refused(openai.BadRequestError, 400, n=2)
        with self.assertRaises(openai.BadRequestError):
            self.client.chat.completions.create(model=self.model, messages=[], max_tokens=4)
        self.assert_healthy()

        status, body = self.server.post_raw("/v1/completions", b'{"prompt": "' + b"a" * (100 << 20) + b'"}')
        self.assertEqual(status, 413, body[:300])
        self.assertIn("larger", json.loads(body)["error"]["message"])
        self.assert_healthy()

        status, _ = self.server.post_raw("/v1/no-such-endpoint", b"{}")
        self.assertEqual(status, 404)
        self.assert_healthy()


def main():
    global TPMOE
    parser = argparse.ArgumentParser()
    parser.add_argument("--tpmoe", required=True, help="the tpmoe binary")
    args, rest = parser.parse_known_args()
    TPMOE = args.tpmoe
    unittest.main(argv=[sys.argv[0], "-v", *rest])


if __name__ == "__main__":
    main()
