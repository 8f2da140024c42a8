#!/usr/bin/env python3
"""A local stand-in for the model providers' HTTP APIs, for the contract
tests that run the real agent CLIs offline.

  provider_api.py --port-file F --log-dir D [--mode refuse|reply] [--text T]
                  [--hold-first FILE]

- refuse: every request is answered 401 with the provider's error shape
  (so no model turn can complete: "found" then means the CLI loaded its
  session and failed on auth);
- reply: a valid streamed reply whose text is T (default "stub reply") for
  the Anthropic Messages API (POST …/v1/messages, SSE), the OpenAI Chat
  Completions API (POST …/chat/completions, SSE when "stream" is set) and
  the OpenAI Responses API (POST …/responses, SSE) and the Gemini API
  (POST …:streamGenerateContent, SSE; …:generateContent); other paths 404.

--hold-first FILE keeps the first model call (the first POST) waiting,
without an answer, until FILE exists (at most 10 minutes): a test can stop
a CLI in the middle of its turn.

Every request is written to D as <n>.json ({"method","path","headers",
"body"}), so a test can see what a resumed turn sent. The port it listens on
(127.0.0.1, chosen by the kernel) is written to F once it listens.
"""

import argparse
import http.server
import itertools
import json
import os
import threading
import time
import uuid

COUNTER = itertools.count(1)
LOCK = threading.Lock()


def send_json(handler, status, payload):
    body = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def sse(handler, events):
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.send_header("cache-control", "no-cache")
    # The stream's end is the connection's: no length is known up front.
    handler.send_header("connection", "close")
    handler.close_connection = True
    handler.end_headers()
    for name, data in events:
        chunk = ""
        if name:
            chunk += f"event: {name}\n"
        chunk += f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
        handler.wfile.write(chunk.encode())
        handler.wfile.flush()


def anthropic_events(model, text):
    mid = "msg_" + uuid.uuid4().hex[:24]
    usage = {"input_tokens": 10, "output_tokens": 5}
    return [
        ("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": text}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 5}}),
        ("message_stop", {"type": "message_stop"}),
    ]


def chat_events(model, text):
    cid = "chatcmpl-" + uuid.uuid4().hex[:20]
    base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    return [
        (None, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
        (None, {**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}),
        (None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}),
        (None, "[DONE]"),
    ]


def chat_completion(model, text):
    return {"id": "chatcmpl-" + uuid.uuid4().hex[:20], "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def gemini_response(text):
    return {"candidates": [{"content": {"parts": [{"text": text}], "role": "model"},
                            "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15},
            "modelVersion": "stub-model"}


def responses_events(model, text):
    rid = "resp_" + uuid.uuid4().hex[:24]
    item_id = "msg_" + uuid.uuid4().hex[:24]
    item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    response = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                "status": "in_progress", "output": []}
    done = {**response, "status": "completed", "output": [item],
            "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
    return [
        ("response.created", {"type": "response.created", "response": response}),
        ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                        "item": {**item, "status": "in_progress", "content": []}}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": item_id,
                                        "output_index": 0, "content_index": 0, "delta": text}),
        ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
        ("response.completed", {"type": "response.completed", "response": done}),
    ]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def handle(self):
        # A CLI stopped mid-turn hangs up on its request: not an error here.
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args):
        pass

    def record(self, body):
        with LOCK:
            n = next(COUNTER)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode(errors="replace")
        entry = {"method": self.command, "path": self.path,
                 "headers": {k.lower(): v for k, v in self.headers.items() if k.lower() not in
                             ("authorization", "x-api-key", "x-goog-api-key")},
                 "body": parsed}
        with open(os.path.join(self.server.log_dir, f"{n:05d}.json"), "w") as f:
            json.dump(entry, f)
        return parsed

    def body(self):
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def refuse(self):
        send_json(self, 401, {"type": "error", "error": {"type": "authentication_error",
                                                        "message": "invalid x-api-key"},
                              "code": 401, "message": "invalid api key", "status": "UNAUTHENTICATED"})

    def do_GET(self):
        self.record(b"")
        if self.server.mode == "refuse":
            return self.refuse()
        send_json(self, 200 if self.path.rstrip("/").endswith("/models") else 404,
                  {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    def do_POST(self):
        request = self.record(self.body()) or {}
        hold = self.server.hold_first
        if hold:
            with LOCK:
                first = not self.server.held
                self.server.held = True
            if first:
                deadline = time.time() + 600
                while not os.path.exists(hold) and time.time() < deadline:
                    time.sleep(0.05)
        if self.server.mode == "refuse":
            return self.refuse()
        model = request.get("model", "stub-model") if isinstance(request, dict) else "stub-model"
        text = self.server.text
        path = self.path.split("?")[0]
        if path.endswith("/messages"):
            return sse(self, anthropic_events(model, text))
        if path.endswith("/chat/completions"):
            if request.get("stream"):
                return sse(self, chat_events(model, text))
            return send_json(self, 200, chat_completion(model, text))
        if path.endswith("/responses"):
            return sse(self, responses_events(model, text))
        if path.endswith(":streamGenerateContent"):
            return sse(self, [(None, gemini_response(text))])
        if path.endswith(":generateContent"):
            return send_json(self, 200, gemini_response(text))
        if path.endswith(":countTokens"):
            return send_json(self, 200, {"totalTokens": 10})
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()
        return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--mode", choices=["refuse", "reply"], default="refuse")
    parser.add_argument("--text", default="stub reply")
    parser.add_argument("--hold-first", default=None)
    args = parser.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.log_dir, server.mode, server.text = args.log_dir, args.mode, args.text
    server.hold_first, server.held = args.hold_first, False
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
