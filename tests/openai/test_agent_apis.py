"""The Responses API and the Anthropic Messages API of AgentJet, checked with the official
`openai` and `anthropic` Python packages against a live endpoint of the real default
model (SmolLM2-135M-Instruct).

Run by tests/openai_api.rs against `agentjet-peer serve --track-episodes` and against a
client's proxy over the swarm. It sets:
  AGENTJET_BASE_URL   the endpoint's .../v1 (the Anthropic SDK gets the root without /v1)

Every multi-turn case asserts that the second call's prompt ids start with the first
call's prompt ids followed by its completion ids (token-in-token-out): the API key names
the episode (a bearer token for OpenAI's SDK, x-api-key for Anthropic's).
"""
import json
import os
import unittest
import urllib.error
import urllib.request
import uuid

import anthropic
import openai

BASE = os.environ["AGENTJET_BASE_URL"]
ROOT = BASE[: -len("/v1")] if BASE.endswith("/v1") else BASE
MODEL = "smollm2"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def episode():
    return "episode-" + uuid.uuid4().hex


def oai(key=None):
    return openai.OpenAI(base_url=BASE, api_key=key or episode(), max_retries=0, timeout=120)


def claude(key=None):
    return anthropic.Anthropic(base_url=ROOT, api_key=key or episode(), max_retries=0, timeout=120)


# Anthropic's SDK no longer takes sampling parameters as arguments; the API still reads
# them from the body (older SDKs and raw clients send them).
GREEDY = {"extra_body": {"temperature": 0}}


def ext(r):
    return r.model_extra["agentjet"]


def post_raw(path, body, headers=None):
    req = urllib.request.Request(BASE + path, data=body, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Responses(unittest.TestCase):
    def test_text_whole_and_streamed_with_usage_and_extensions(self):
        r = oai().responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24)
        self.assertEqual(r.status, "completed")
        self.assertEqual(r.output_text, "The capital of France is Paris.")
        self.assertEqual(r.usage.input_tokens, 37)
        self.assertEqual(r.usage.total_tokens, r.usage.input_tokens + r.usage.output_tokens)
        self.assertEqual(len(ext(r)["prompt_token_ids"]), 37)
        self.assertEqual(len(ext(r)["token_ids"]), r.usage.output_tokens)
        kinds, deltas, done = [], [], None
        for ev in oai().responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24,
                                         stream=True):
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            if ev.type == "response.completed":
                done = ev.response
        self.assertEqual(kinds[:2], ["response.created", "response.in_progress"])
        self.assertEqual(kinds[2:4], ["response.output_item.added", "response.content_part.added"])
        self.assertEqual(kinds[-4:], ["response.output_text.done", "response.content_part.done",
                                      "response.output_item.done", "response.completed"])
        self.assertEqual("".join(deltas), r.output_text)
        self.assertEqual(done.output_text, r.output_text)

    def test_max_output_tokens_makes_an_incomplete_response(self):
        r = oai().responses.create(model=MODEL, input="Write a long story about the sea.", temperature=0,
                                   max_output_tokens=5)
        self.assertEqual(r.status, "incomplete")
        self.assertEqual(r.incomplete_details.reason, "max_output_tokens")
        self.assertEqual(r.usage.output_tokens, 5)

    def function_call(self, c, tool_choice, stream=False):
        tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
                  "parameters": WEATHER, "strict": True}]
        msgs = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        args = dict(model=MODEL, input=msgs, tools=tools, tool_choice=tool_choice, temperature=0,
                    max_output_tokens=80, instructions="You are a helpful assistant.")
        if not stream:
            return tools, msgs, c.responses.create(**args)
        kinds, final = [], None
        for ev in c.responses.create(stream=True, **args):
            kinds.append(ev.type)
            if ev.type == "response.completed":
                final = ev.response
        self.assertIn("response.function_call_arguments.delta", kinds)
        self.assertIn("response.function_call_arguments.done", kinds)
        self.assertEqual(kinds[-1], "response.completed")
        return tools, msgs, final

    def test_function_tool_round_trip_continues_the_exact_ids(self):
        c = oai()
        tools, msgs, first = self.function_call(c, {"type": "function", "name": "get_weather"})
        calls = [o for o in first.output if o.type == "function_call"]
        self.assertEqual(len(calls), 1, first.output)
        self.assertEqual(calls[0].name, "get_weather")
        self.assertIsInstance(json.loads(calls[0].arguments), dict)
        self.assertEqual(ext(first)["timeline"], "first")
        history = msgs + [o.model_dump(exclude_none=True) for o in first.output]
        history.append({"type": "function_call_output", "call_id": calls[0].call_id,
                        "output": json.dumps({"temperature_c": 18, "sky": "sunny"})})
        second = c.responses.create(model=MODEL, input=history, tools=tools, tool_choice="none", temperature=0,
                                    max_output_tokens=40, instructions="You are a helpful assistant.")
        self.assertTrue(second.output_text.strip(), second)
        self.assertEqual(ext(second)["timeline"], "continued")
        p1, c1, p2 = ext(first)["prompt_token_ids"], ext(first)["token_ids"], ext(second)["prompt_token_ids"]
        self.assertEqual(p2[:len(p1) + len(c1)], p1 + c1)
        self.assertGreater(len(p2), len(p1) + len(c1))

    def test_streamed_function_call_and_previous_response_id(self):
        c = oai()
        tools, _, first = self.function_call(c, "required", stream=True)
        calls = [o for o in first.output if o.type == "function_call"]
        self.assertEqual(len(calls), 1, first.output)
        self.assertIsInstance(json.loads(calls[0].arguments), dict)
        # The server kept the conversation: only the tool's output is sent.
        second = c.responses.create(model=MODEL, previous_response_id=first.id, temperature=0,
                                    max_output_tokens=40, tool_choice="none", tools=tools,
                                    instructions="You are a helpful assistant.",
                                    input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": "18 C and sunny"}])
        self.assertEqual(second.previous_response_id, first.id)
        self.assertEqual(ext(second)["timeline"], "continued")
        p1, c1, p2 = ext(first)["prompt_token_ids"], ext(first)["token_ids"], ext(second)["prompt_token_ids"]
        self.assertEqual(p2[:len(p1) + len(c1)], p1 + c1)
        # A third turn on top of the second, text only.
        third = c.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks! And tomorrow?",
                                   temperature=0, max_output_tokens=16, instructions="You are a helpful assistant.",
                                   tools=tools, tool_choice="none")
        p3 = ext(third)["prompt_token_ids"]
        c2 = ext(second)["token_ids"]
        self.assertEqual(p3[:len(p2) + len(c2)], p2 + c2)

    def test_previous_response_id_of_another_episode_or_unknown_is_400(self):
        r = oai().responses.create(model=MODEL, input="Name a fruit.", temperature=0, max_output_tokens=8)
        for key, rid in [(None, r.id), (None, "resp_doesnotexist")]:
            with self.assertRaises(openai.BadRequestError) as cm:
                oai(key).responses.create(model=MODEL, previous_response_id=rid, input="Another?")
            self.assertEqual(cm.exception.body["param"], "previous_response_id")
        unstored = oai().responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
        with self.assertRaises(openai.BadRequestError):
            oai().responses.create(model=MODEL, previous_response_id=unstored.id, input="Again")

    def test_fields_that_do_not_change_the_answer_are_accepted(self):
        r = oai().responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24,
                                   store=True, metadata={"run": "t"}, user="u1", parallel_tool_calls=True,
                                   include=[], truncation="disabled", text={"format": {"type": "text"}})
        self.assertEqual(r.output_text, "The capital of France is Paris.")

    def test_unsupported_parts_and_bad_items_are_400_naming_them(self):
        cases = [
            (dict(input=QUESTION, tools=[{"type": "web_search"}]), "tools[0].type"),
            (dict(input=QUESTION, background=True), "background"),
            (dict(input=QUESTION, truncation="auto"), "truncation"),
            (dict(input=QUESTION, include=["file_search_call.results"]), "include[0]"),
            (dict(input=[{"type": "reasoning", "id": "rs_1", "summary": []}]), "input[0].type"),
            (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
             "input[0].content[0].type"),
            (dict(input=[{"role": "user", "content": "hi"},
                         {"type": "function_call_output", "call_id": "call_x", "output": "1"}]), "input[1].call_id"),
            (dict(input=QUESTION, tool_choice={"type": "function", "name": "nope"},
                  tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}]), "tool_choice"),
            (dict(input=QUESTION, temperature=7), "temperature"),
        ]
        for kwargs, param in cases:
            with self.assertRaises(openai.BadRequestError, msg=param) as cm:
                oai().responses.create(model=MODEL, **kwargs)
            self.assertEqual(cm.exception.status_code, 400)
            self.assertEqual(cm.exception.body["param"], param, cm.exception.body)
        status, body = post_raw("/responses", json.dumps({"model": MODEL, "input": 5}).encode())
        self.assertEqual((status, body["error"]["param"]), (400, "input"))
        status, body = post_raw("/responses", b'{"model": "smollm2", "input": [')
        self.assertEqual(status, 400)
        status, body = post_raw("/responses", json.dumps({"model": "gpt-7", "input": "hi"}).encode())
        self.assertEqual((status, body["error"]["code"]), (404, "model_not_found"))
        big = json.dumps({"model": MODEL, "input": "x" * ((8 << 20) + 1024)}).encode()
        status, body = post_raw("/responses", big)
        self.assertEqual((status, body["error"]["code"]), (413, "request_too_large"))
        # and the server keeps serving
        r = oai().responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24)
        self.assertEqual(r.output_text, "The capital of France is Paris.")


class Messages(unittest.TestCase):
    def test_text_whole_and_streamed(self):
        q = [{"role": "user", "content": QUESTION}]
        m = claude().messages.create(model=MODEL, max_tokens=24, messages=q, **GREEDY)
        self.assertEqual(m.content[0].type, "text")
        self.assertEqual(m.content[0].text, "The capital of France is Paris.")
        self.assertEqual(m.stop_reason, "end_turn")
        self.assertEqual(m.usage.input_tokens, 37)
        self.assertEqual(len(ext(m)["token_ids"]), m.usage.output_tokens)
        with claude().messages.stream(model=MODEL, max_tokens=24, messages=q, **GREEDY) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        self.assertEqual(text, m.content[0].text)
        self.assertEqual(final.stop_reason, "end_turn")
        kinds = [ev.type for ev in claude().messages.create(model=MODEL, max_tokens=24, messages=q, stream=True,
                                                            **GREEDY)]
        self.assertEqual(kinds[:2], ["message_start", "content_block_start"])
        self.assertIn("content_block_delta", kinds)
        self.assertEqual(kinds[-3:], ["content_block_stop", "message_delta", "message_stop"])

    def test_system_stop_sequences_and_max_tokens(self):
        m = claude().messages.create(model=MODEL, max_tokens=24, stop_sequences=["Paris"],
                                     messages=[{"role": "user", "content": QUESTION}], **GREEDY)
        self.assertEqual(m.stop_reason, "stop_sequence")
        self.assertEqual(m.stop_sequence, "Paris")
        self.assertNotIn("Paris", m.content[0].text)
        m = claude().messages.create(model=MODEL, max_tokens=3, system="Be verbose.",
                                     messages=[{"role": "user", "content": "Describe the sea."}], **GREEDY)
        self.assertEqual((m.stop_reason, m.usage.output_tokens), ("max_tokens", 3))

    def tool_use(self, c, tool_choice, stream=False):
        tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
        msgs = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        args = dict(model=MODEL, max_tokens=80, tools=tools, tool_choice=tool_choice, messages=msgs, **GREEDY)
        if not stream:
            m = c.messages.create(**args)
            return tools, msgs, m, ext(m)
        kinds, extension = [], None
        with c.messages.stream(**args) as s:
            for ev in s:
                kinds.append(ev.type)
                if ev.type == "message_delta":  # the token-id extension rides on it
                    extension = ev.model_extra["agentjet"]
            m = s.get_final_message()
        self.assertIn("input_json", kinds)
        return tools, msgs, m, extension

    def test_tool_use_round_trip_continues_the_exact_ids(self):
        for stream in (False, True):
            c = claude()
            tools, msgs, first, first_ext = self.tool_use(c, {"type": "tool", "name": "get_weather"}, stream)
            self.assertEqual(first.stop_reason, "tool_use")
            uses = [b for b in first.content if b.type == "tool_use"]
            self.assertEqual(len(uses), 1, first.content)
            self.assertEqual(uses[0].name, "get_weather")
            self.assertIsInstance(uses[0].input, dict)
            self.assertTrue(uses[0].id.startswith("toolu_"))
            msgs2 = msgs + [{"role": "assistant", "content": first.content},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                          "content": "18 C and sunny"}]}]
            second = c.messages.create(model=MODEL, max_tokens=40, tools=tools,
                                       tool_choice={"type": "none"}, messages=msgs2, **GREEDY)
            self.assertEqual(second.content[0].type, "text")
            self.assertEqual(ext(second)["timeline"], "continued", stream)
            p1, c1, p2 = first_ext["prompt_token_ids"], first_ext["token_ids"], ext(second)["prompt_token_ids"]
            self.assertEqual(p2[:len(p1) + len(c1)], p1 + c1)

    def test_an_episode_may_mix_the_apis(self):
        """One episode, three APIs: each call continues the previous call's exact ids."""
        key = episode()
        q = [{"role": "user", "content": "Name a fruit."}]
        first = oai(key).chat.completions.create(model=MODEL, messages=q, temperature=0, max_tokens=12)
        answer = first.choices[0].message.content
        second = claude(key).messages.create(model=MODEL, max_tokens=12, **GREEDY, messages=q + [
            {"role": "assistant", "content": answer}, {"role": "user", "content": "Another one?"}])
        third = oai(key).responses.create(model=MODEL, temperature=0, max_output_tokens=12, input=q + [
            {"role": "assistant", "content": answer}, {"role": "user", "content": "Another one?"},
            {"role": "assistant", "content": second.content[0].text}, {"role": "user", "content": "And one more?"}])
        p1, c1 = ext(first)["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
        p2, c2 = ext(second)["prompt_token_ids"], ext(second)["token_ids"]
        p3 = ext(third)["prompt_token_ids"]
        self.assertEqual(p2[:len(p1) + len(c1)], p1 + c1)
        self.assertEqual(p3[:len(p2) + len(c2)], p2 + c2)
        self.assertEqual([ext(second)["timeline"], ext(third)["timeline"]], ["continued", "continued"])

    def test_errors_are_in_anthropic_shape_and_the_server_keeps_serving(self):
        q = [{"role": "user", "content": QUESTION}]
        cases = [
            (dict(messages=q), 400),  # no max_tokens
            (dict(messages=q, max_tokens=8, temperature=1.5), 400),
            (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}], max_tokens=8), 400),
            (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}],
                  max_tokens=8), 400),
            (dict(messages=q, max_tokens=8, tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400),
            (dict(messages=q, max_tokens=8, thinking={"type": "enabled", "budget_tokens": 1024}), 400),
            (dict(messages=[{"role": "system", "content": "x"}], max_tokens=8), 400),
            (dict(messages=q, max_tokens=8, model="claude-7"), 404),
        ]
        for body, status in cases:
            body = {"model": MODEL, **body}
            got, err = post_raw("/messages", json.dumps(body).encode(), {"x-api-key": episode()})
            self.assertEqual(got, status, (body, err))
            self.assertEqual(err["type"], "error", err)
            want = "not_found_error" if status == 404 else "invalid_request_error"
            self.assertEqual(err["error"]["type"], want, err)
            self.assertTrue(err["error"]["message"], err)
        with self.assertRaises(anthropic.BadRequestError) as cm:
            claude().messages.create(model=MODEL, max_tokens=8, messages=q, extra_body={"top_k": "many"})
        self.assertEqual(cm.exception.body["error"]["type"], "invalid_request_error")
        big = json.dumps({"model": MODEL, "max_tokens": 8,
                          "messages": [{"role": "user", "content": "x" * ((8 << 20) + 1024)}]}).encode()
        got, err = post_raw("/messages", big)
        self.assertEqual((got, err["error"]["type"]), (413, "request_too_large"))
        got, err = post_raw("/messages", b'{"model": "smollm2", "messages": [')
        self.assertEqual((got, err["type"]), (400, "error"))
        m = claude().messages.create(model=MODEL, max_tokens=24, messages=q, **GREEDY)
        self.assertEqual(m.content[0].text, "The capital of France is Paris.")


    def test_output_config_format_gives_json_of_the_schema_and_effort_is_refused(self):
        schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                  "required": ["city", "country"], "additionalProperties": False}
        m = claude().messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": QUESTION}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
        v = json.loads(m.content[0].text)
        self.assertIsInstance(v["city"], str)
        self.assertIsInstance(v["country"], str)
        self.assertEqual(m.stop_reason, "end_turn")
        with self.assertRaises(anthropic.BadRequestError):
            claude().messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": QUESTION}],
                                     output_config={"effort": "max"})
        # Fields that change nothing are accepted.
        m = claude().messages.create(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": QUESTION}],
                                     metadata={"user_id": "u"}, service_tier="auto", inference_geo="us",
                                     cache_control={"type": "ephemeral"}, **GREEDY)
        self.assertEqual(m.content[0].text, "The capital of France is Paris.")


if __name__ == "__main__":
    unittest.main()
