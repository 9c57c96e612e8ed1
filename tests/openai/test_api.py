"""The OpenAI-compatible API of `agentjet-peer serve`, checked with the official `openai`
Python package against a live server of the real default model (SmolLM2-135M-Instruct).

Run by tests/openai_api.rs, which starts two servers and sets:
  AGENTJET_BASE_URL        a server with default limits
  AGENTJET_TIGHT_BASE_URL  a server with --max-batch 1 --max-queue 1 (for 429)
"""
import json
import os
import threading
import unittest
import urllib.error
import urllib.request

import openai

BASE = os.environ["AGENTJET_BASE_URL"]
TIGHT = os.environ["AGENTJET_TIGHT_BASE_URL"]
MODEL = "smollm2"
Q = [{"role": "user", "content": "What is the capital of France?"}]


def client(base=BASE):
    return openai.OpenAI(base_url=base, api_key="episode-test", max_retries=0, timeout=120)


class Chat(unittest.TestCase):
    def test_models_list(self):
        ids = [m.id for m in client().models.list().data]
        self.assertEqual(ids, [MODEL])

    def test_greedy_answer_usage_and_extensions(self):
        r = client().chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=24)
        self.assertEqual(r.choices[0].message.content, "The capital of France is Paris.")
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.usage.prompt_tokens, 37)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        extra = r.model_extra["agentjet"]
        self.assertEqual(len(extra["prompt_token_ids"]), 37)
        self.assertEqual(extra["policy_version"], 0)
        self.assertEqual(len(r.choices[0].model_extra["token_ids"]), r.usage.completion_tokens)

    def test_streamed_text_equals_non_streamed_for_same_seed(self):
        args = dict(model=MODEL, messages=[{"role": "user", "content": "Write two sentences about the sea."}],
                    temperature=0.9, top_p=0.95, seed=1234, max_tokens=40)
        whole = client().chat.completions.create(**args).choices[0].message.content
        parts, finish, usage = [], None, None
        for chunk in client().chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.content:
                    parts.append(c.delta.content)
                if c.finish_reason:
                    finish = c.finish_reason
        self.assertEqual("".join(parts), whole)
        self.assertIn(finish, ("stop", "length"))
        self.assertIsNotNone(usage)

    def test_seed_reproducible_and_seeds_differ(self):
        args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0, max_tokens=30)
        a = client().chat.completions.create(seed=7, **args).choices[0].message.content
        b = client().chat.completions.create(seed=7, **args).choices[0].message.content
        c = client().chat.completions.create(seed=8, **args).choices[0].message.content
        self.assertEqual(a, b)
        self.assertNotEqual(a, c)

    def test_n2_gives_two_choices(self):
        r = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                                             n=2, temperature=1.0, seed=3, max_tokens=20)
        self.assertEqual([c.index for c in r.choices], [0, 1])
        self.assertNotEqual(r.choices[0].message.content, r.choices[1].message.content)
        self.assertEqual(r.usage.completion_tokens, sum(len(c.model_extra["token_ids"]) for c in r.choices))

    def test_logprobs_with_top_logprobs(self):
        r = client().chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=8,
                                             logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        for t in content:
            self.assertEqual(len(t.top_logprobs), 3)
            # greedy: the sampled token is the most likely one
            self.assertEqual(t.token, t.top_logprobs[0].token)
            self.assertAlmostEqual(t.logprob, t.top_logprobs[0].logprob, places=6)
            self.assertLessEqual(t.logprob, 0.0)
            self.assertGreaterEqual(t.top_logprobs[0].logprob, t.top_logprobs[1].logprob)

    def test_stop_strings(self):
        r = client().chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=24, stop=[" Paris", "zzz"])
        self.assertEqual(r.choices[0].message.content, "The capital of France is")
        self.assertEqual(r.choices[0].finish_reason, "stop")
        parts = []
        for chunk in client().chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=24,
                                                      stop=" Paris", stream=True):
            parts += [c.delta.content for c in chunk.choices if c.delta.content]
        self.assertEqual("".join(parts), "The capital of France is")

    def test_max_completion_tokens_and_length(self):
        r = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to one hundred."}],
                                             temperature=0, max_completion_tokens=5)
        self.assertEqual(r.usage.completion_tokens, 5)
        self.assertEqual(r.choices[0].finish_reason, "length")

    def test_logit_bias_and_penalties(self):
        c = client()
        first = c.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=4)
        banned = first.choices[0].model_extra["token_ids"][0]
        r = c.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=4, logit_bias={str(banned): -100})
        self.assertNotEqual(r.choices[0].model_extra["token_ids"][0], banned)
        rep = [{"role": "user", "content": "Repeat after me: apple apple apple apple apple apple apple apple apple apple"}]
        plain = c.chat.completions.create(model=MODEL, messages=rep, temperature=0, max_tokens=24)
        pen = c.chat.completions.create(model=MODEL, messages=rep, temperature=0, max_tokens=24, frequency_penalty=1.5)

        def most_repeated(r):
            ids = r.choices[0].model_extra["token_ids"]
            return max(ids.count(t) for t in set(ids))

        self.assertLess(most_repeated(pen), most_repeated(plain))

    def test_completions_text_and_token_prompts(self):
        c = client()
        a = c.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, logprobs=2)
        ids = a.model_extra["agentjet"]["prompt_token_ids"]
        b = c.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=5)
        self.assertEqual(a.choices[0].text, b.choices[0].text)
        self.assertEqual(len(a.choices[0].logprobs.tokens), 5)
        self.assertEqual(len(a.choices[0].logprobs.top_logprobs[0]), 2)
        e = c.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=3, echo=True)
        self.assertTrue(e.choices[0].text.startswith("Hello"))

    def test_completions_streaming_equals_non_streaming(self):
        args = dict(model=MODEL, prompt="Once upon a time", temperature=0.8, seed=11, max_tokens=20, logprobs=1)
        whole = client().completions.create(**args)
        parts, lps, finish, usage = [], [], None, None
        for chunk in client().completions.create(stream=True, stream_options={"include_usage": True}, **args):
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                parts.append(c.text)
                if c.logprobs:
                    lps += c.logprobs.token_logprobs
                if c.finish_reason:
                    finish = c.finish_reason
                    token_ids = c.model_extra["token_ids"]
        self.assertEqual("".join(parts), whole.choices[0].text)
        self.assertEqual(token_ids, whole.choices[0].model_extra["token_ids"])
        self.assertEqual(lps, whole.choices[0].logprobs.token_logprobs)
        self.assertEqual(finish, whole.choices[0].finish_reason)
        self.assertEqual(usage.completion_tokens, whole.usage.completion_tokens)
        echoed = "".join(c.text for chunk in client().completions.create(
            model=MODEL, prompt="Hello", temperature=0, max_tokens=3, echo=True, stream=True) for c in chunk.choices)
        self.assertTrue(echoed.startswith("Hello") and len(echoed) > len("Hello"))

    def test_json_object_mode_always_parses(self):
        msgs = [{"role": "user", "content": "Describe a cat as a JSON object with keys name, age and colors."}]
        r = client().chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "json_object"},
                                             temperature=1.0, seed=5, n=4, max_tokens=200)
        # A sample may run on (a list that never ends) until max_tokens; one that stops has
        # closed its object and parses.
        stopped = [c for c in r.choices if c.finish_reason == "stop"]
        self.assertGreaterEqual(len(stopped), 2, [c.message.content for c in r.choices])
        for c in stopped:
            self.assertIsInstance(json.loads(c.message.content), dict, c.message.content)
        # streamed text equals the non-streamed text for the same seed
        one = dict(model=MODEL, messages=msgs, response_format={"type": "json_object"}, temperature=1.0, seed=6,
                   max_tokens=200)
        whole = client().chat.completions.create(**one).choices[0].message.content
        streamed = "".join(c.delta.content or "" for chunk in client().chat.completions.create(stream=True, **one)
                           for c in chunk.choices)
        self.assertEqual(streamed, whole)
        self.assertIsInstance(json.loads(whole), dict)

    def test_json_schema_response_format(self):
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                                   "indoor": {"type": "boolean"}, "color": {"enum": ["black", "white", "orange"]}}}
        r = client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}], temperature=0.7, seed=2, n=3,
            max_tokens=120, response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}})
        for c in r.choices:
            self.assertEqual(c.finish_reason, "stop", c.message.content)
            v = json.loads(c.message.content)
            self.assertEqual(list(v), ["name", "age", "indoor", "color"], c.message.content)
            self.assertLessEqual(len(v["name"]), 24)
            self.assertIsInstance(v["name"], str)
            self.assertIsInstance(v["age"], int)
            self.assertIsInstance(v["indoor"], bool)
            self.assertIn(v["color"], ["black", "white", "orange"])

    def test_tool_round_trip(self):
        """tools -> tool_calls -> tool message -> answer. SmolLM2's template has no tool
        support: the server writes the Hermes tool instructions into the system message,
        tool_choice forces a well-formed call, and the call and the tool's answer are
        rendered back in the same format."""
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
        msgs = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        c = client()
        first = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, temperature=0, max_tokens=80,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = first.choices[0]
        self.assertEqual(choice.finish_reason, "tool_calls")
        call = choice.message.tool_calls[0]
        self.assertEqual(call.type, "function")
        self.assertEqual(call.function.name, "get_weather")
        self.assertIsInstance(json.loads(call.function.arguments), dict)
        # "required": any of the tools, streamed as a tool_calls delta
        streamed_calls, finish = [], None
        for chunk in c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, temperature=0,
                                               max_tokens=80, tool_choice="required", stream=True):
            for ch in chunk.choices:
                streamed_calls += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        self.assertEqual(finish, "tool_calls")
        self.assertIn(streamed_calls[0].function.name, ("get_weather", "get_time"))
        self.assertIsInstance(json.loads(streamed_calls[0].function.arguments), dict)
        # the tool answers; the model answers in text
        msgs2 = msgs + [choice.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "{\"temperature_c\": 18, \"sky\": \"sunny\"}"}]
        second = c.chat.completions.create(model=MODEL, messages=msgs2, tools=tools, tool_choice="none",
                                           temperature=0, max_tokens=40)
        answer = second.choices[0].message
        self.assertTrue(answer.content and answer.content.strip(), answer)
        # The second prompt extends the first: the conversation so far renders the same.
        p1 = first.model_extra["agentjet"]["prompt_token_ids"]
        p2 = second.model_extra["agentjet"]["prompt_token_ids"]
        self.assertEqual(p2[:len(p1)], p1)
        self.assertGreater(len(p2), len(p1) + len(choice.model_extra["token_ids"]))

    def test_episode_calls_extend_the_exact_ids(self):
        """The server runs with --track-episodes: the API key names the episode, and a
        call that repeats the conversation plus the model's answer extends the previous
        prompt and completion ids exactly (token-in-token-out)."""
        c = openai.OpenAI(base_url=BASE, api_key="episode-ttio-1", max_retries=0, timeout=120)
        m1 = [{"role": "user", "content": "Name a fruit."}]
        r1 = c.chat.completions.create(model=MODEL, messages=m1, temperature=0, max_tokens=24)
        self.assertEqual(r1.model_extra["agentjet"]["timeline"], "first")
        p1 = r1.model_extra["agentjet"]["prompt_token_ids"]
        c1 = r1.choices[0].model_extra["token_ids"]
        m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                   {"role": "user", "content": "Another one?"}]
        r2 = c.chat.completions.create(model=MODEL, messages=m2, temperature=0, max_tokens=24)
        self.assertEqual(r2.model_extra["agentjet"]["timeline"], "continued")
        p2 = r2.model_extra["agentjet"]["prompt_token_ids"]
        self.assertEqual(p2[:len(p1) + len(c1)], p1 + c1)
        # An agent that edits the answer breaks the timeline, and the break is counted.
        m3 = m2 + [{"role": "assistant", "content": "Something else entirely."},
                   {"role": "user", "content": "Ok."}]
        r3 = c.chat.completions.create(model=MODEL, messages=m3, temperature=0, max_tokens=8)
        self.assertEqual(r3.model_extra["agentjet"]["timeline"], "break")
        with urllib.request.urlopen(BASE.replace("/v1", "") + "/metrics") as m:
            text = m.read().decode()
        self.assertIn('agentjet_timeline_calls_total{model="smollm2",outcome="continued"}', text)
        breaks = [l for l in text.splitlines() if 'outcome="break"' in l]
        self.assertTrue(breaks and int(breaks[0].split()[-1]) >= 1, breaks)


class Load(unittest.TestCase):
    def test_64_streams_with_a_third_disconnecting(self):
        prompts = [f"List {k} fruits, one per line." for k in range(2, 10)]
        expected = {p: client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                        temperature=0, max_tokens=32).choices[0].message.content
                    for p in prompts}
        results, errors = {}, []

        def one(i):
            p = prompts[i % len(prompts)]
            try:
                stream = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                          temperature=0, max_tokens=32, stream=True)
                parts = []
                for n, chunk in enumerate(stream):
                    parts += [c.delta.content for c in chunk.choices if c.delta.content]
                    if i % 3 == 2 and n == 3:
                        stream.close()  # walk away mid-stream
                        return
                results[i] = (p, "".join(parts))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{i}: {e!r}")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(len(results), 64 - len(range(2, 64, 3)))
        for i, (p, text) in results.items():
            self.assertEqual(text, expected[p], f"stream {i}")
        # The server keeps serving, and its KV memory is back to idle.
        r = client().chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=24)
        self.assertEqual(r.choices[0].message.content, "The capital of France is Paris.")
        import time
        for _ in range(100):
            with urllib.request.urlopen(BASE.replace("/v1", "") + "/metrics") as m:
                text = m.read().decode()
            kv = [l for l in text.splitlines() if l.startswith("agentjet_engine_kv_bytes")]
            if kv and kv[0].endswith(" 0"):
                break
            time.sleep(0.1)
        self.assertTrue(kv[0].endswith(" 0"), kv)


class Errors(unittest.TestCase):
    def assert_error(self, exc, status, param=None, code=None):
        self.assertEqual(exc.status_code, status)
        body = exc.response.json()
        self.assertIn("message", body["error"])
        self.assertIn("type", body["error"])
        if param is not None:
            self.assertEqual(body["error"]["param"], param)
        if code is not None:
            self.assertEqual(body["error"]["code"], code)

    def test_unknown_model_is_404(self):
        with self.assertRaises(openai.NotFoundError) as cm:
            client().chat.completions.create(model="gpt-7", messages=Q)
        self.assert_error(cm.exception, 404, "model", "model_not_found")

    def test_bad_fields_are_400_naming_the_field(self):
        for kwargs, param in [(dict(temperature=5), "temperature"), (dict(top_p=0), "top_p"), (dict(n=0), "n"),
                              (dict(max_tokens=0), "max_tokens"), (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
                              (dict(presence_penalty=3), "presence_penalty"), (dict(logit_bias={"abc": 1}), "logit_bias"),
                              (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
                               "response_format.json_schema.schema"),
                              (dict(response_format={"type": "yaml"}), "response_format"),
                              (dict(tool_choice="required"), "tool_choice"),
                              (dict(tools=[{"type": "function", "function": {"name": "f"}}],
                                    tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
                              (dict(tools=[{"type": "function"}]), "tools[0].function.name")]:
            with self.assertRaises(openai.BadRequestError) as cm:
                client().chat.completions.create(model=MODEL, messages=Q, **kwargs)
            self.assert_error(cm.exception, 400, param)
        with self.assertRaises(openai.BadRequestError) as cm:
            client().chat.completions.create(model=MODEL, messages=[])
        self.assert_error(cm.exception, 400, "messages")

    def test_wrong_types_and_broken_json_are_400(self):
        req = urllib.request.Request(BASE + "/chat/completions", data=b'{"model": "smollm2", "messages": [', method="POST",
                                     headers={"content-type": "application/json"})
        with self.assertRaises(urllib.error.HTTPError) as cm:
            urllib.request.urlopen(req)
        self.assertEqual(cm.exception.code, 400)
        self.assertIn("error", json.loads(cm.exception.read()))
        req = urllib.request.Request(BASE + "/chat/completions", method="POST", headers={"content-type": "application/json"},
                                     data=json.dumps({"model": MODEL, "messages": Q, "temperature": "hot"}).encode())
        with self.assertRaises(urllib.error.HTTPError) as cm:
            urllib.request.urlopen(req)
        body = json.loads(cm.exception.read())
        self.assertEqual(cm.exception.code, 400)
        self.assertEqual(body["error"]["param"], "temperature")

    def test_oversize_body_is_413_in_openai_shape(self):
        # Just over the 8 MiB limit, so the few unread bytes fit the socket buffers and the
        # client reads the answer rather than a reset.
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * ((8 << 20) + 1024)}]}).encode()
        req = urllib.request.Request(BASE + "/chat/completions", data=big, method="POST",
                                     headers={"content-type": "application/json"})
        with self.assertRaises(urllib.error.HTTPError) as cm:
            urllib.request.urlopen(req)
        self.assertEqual(cm.exception.code, 413)
        body = json.loads(cm.exception.read())
        self.assertEqual(body["error"]["code"], "request_too_large")
        # and the server still answers
        r = client().chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=8)
        self.assertTrue(r.choices[0].message.content)

    def test_context_too_long_says_the_limits(self):
        with self.assertRaises(openai.BadRequestError) as cm:
            client().chat.completions.create(model=MODEL, messages=Q, max_tokens=9000)
        self.assert_error(cm.exception, 400, code="context_length_exceeded")
        message = cm.exception.response.json()["error"]["message"]
        self.assertIn("maximum context length is", message)
        self.assertIn("9037 tokens (37 in the prompt, 9000 for the completion)", message)

    def test_full_queue_is_429(self):
        results = []

        def one():
            try:
                client(TIGHT).chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=48,
                                                      stop=["zzz"], extra_body={"top_k": 1})
                results.append("ok")
            except openai.RateLimitError as e:
                self.assertEqual(e.response.json()["error"]["code"], "overloaded")
                results.append(429)

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertIn(429, results)
        self.assertIn("ok", results)

    def test_health_and_metrics(self):
        with urllib.request.urlopen(BASE.replace("/v1", "") + "/health") as r:
            self.assertEqual(json.loads(r.read())["status"], "ok")
        with urllib.request.urlopen(BASE.replace("/v1", "") + "/metrics") as r:
            text = r.read().decode()
        self.assertIn("agentjet_engine_kv_bytes", text)
        self.assertIn("agentjet_http_requests_total", text)


if __name__ == "__main__":
    unittest.main()
