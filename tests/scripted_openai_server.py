"""A scripted OpenAI-compatible server for tests: NOT a model. It answers POST /v1/chat/completions
with the next answer of a fixed script (a JSON list of strings), in the OpenAI response shape, and
appends each request's body to a log file. Run: python scripted_openai_server.py SCRIPT LOG PORTFILE.
(specpilot's own `specpilot serve` is being built separately; until it lands the LLM proposer is
tested against this.)"""

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

script_path, log_path, port_file = sys.argv[1:4]
answers = json.load(open(script_path))
state = {"i": 0}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(log_path, "a") as f:
            f.write(body.decode() + "\n")
        if self.path.rstrip("/") != "/v1/chat/completions":
            self.send_response(404)
            self.end_headers()
            return
        text = answers[min(state["i"], len(answers) - 1)]
        state["i"] += 1
        doc = {"id": f"scripted-{state['i']}", "object": "chat.completion", "created": int(time.time()),
               "model": json.loads(body).get("model", "scripted"),
               "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
               "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        out = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
with open(port_file + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
import os  # noqa: E402

os.replace(port_file + ".tmp", port_file)
server.serve_forever()
