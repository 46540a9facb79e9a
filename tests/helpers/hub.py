"""A Hugging Face Hub on loopback, as much of it as huggingface_hub's create_repo and upload_folder call: repo
creation, README metadata validation, preupload (every file "regular": sent inline) and the NDJSON commit.

Every request is recorded (method, path, the Authorization header), and every committed file's bytes by repo and
path: a test reads what a push would have published, and where the token was sent.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeHub:
    url: str
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Authorization)
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo → path → bytes
    server: ThreadingHTTPServer | None = None

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def start_hub() -> FakeHub:
    hub = FakeHub("")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _reply(self, doc: dict, code: int = 200) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            hub.requests.append(("GET", self.path, self.headers.get("Authorization")))
            self._reply({"error": "not here"}, 404)

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hub.requests.append(("POST", self.path, self.headers.get("Authorization")))
            path = self.path.split("?")[0]
            if path == "/api/repos/create":
                doc = json.loads(body)
                repo = f"{doc.get('organization')}/{doc['name']}"
                return self._reply({"url": f"{hub.url}/{repo}", "name": repo, "id": repo})
            if path == "/api/validate-yaml":
                return self._reply({})
            parts = path.split("/")  # /api/models/NS/NAME/(preupload|commit)/REV
            if len(parts) == 7 and parts[1:3] == ["api", "models"] and parts[5] == "preupload":
                files = json.loads(body)["files"]
                return self._reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files]})
            if len(parts) == 7 and parts[1:3] == ["api", "models"] and parts[5] == "commit":
                repo = f"{parts[3]}/{parts[4]}"
                for line in body.splitlines():
                    item = json.loads(line)
                    if item.get("key") == "file":
                        v = item["value"]
                        hub.files.setdefault(repo, {})[v["path"]] = base64.b64decode(v["content"])
                return self._reply({"commitUrl": f"{hub.url}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40,
                                    "pullRequestUrl": None})
            return self._reply({"error": f"no {path}"}, 404)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hub.server, hub.url = server, f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True).start()
    return hub
