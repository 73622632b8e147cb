"""A stand-in for the Hugging Face Hub: the few HTTP routes ``huggingface_hub`` calls to push a model.

``StandInHub`` runs ``http.server`` in a thread on 127.0.0.1 (a free port) and keeps
repositories in memory. It answers what ``huggingface_hub`` 2.x sends for:

* ``whoami``: ``GET /api/whoami-v2``
* ``repo_info`` / ``repo_exists``: ``GET /api/models/{id}`` (``/revision/{rev}``)
* ``create_repo``: ``POST /api/repos/create`` (409 when it exists); a new repo holds
  ``.gitattributes`` like a real one
* ``create_branch``: ``POST /api/models/{id}/branch/{branch}``
* ``list_repo_tree`` / ``list_repo_files``: ``GET /api/models/{id}/tree/{rev}``
* ``create_commit`` / ``upload_folder``: ``POST /api/validate-yaml`` (for ``README.md``),
  ``POST /api/models/{id}/preupload/{rev}`` (answers ``regular`` for every file, or ``lfs`` for
  names matching ``lfs_patterns``), the LFS batch API ``POST /{id}.git/info/lfs/objects/batch``
  with a basic-transfer ``PUT /_lfs/{oid}``, and ``POST /api/models/{id}/commit/{rev}``
  (NDJSON: base64 inline files, LFS pointers, deletions)
* ``hf_hub_download`` (what ``ModelCard.load`` in ``push_to_hub`` uses):
  ``HEAD``/``GET /{id}/resolve/{rev}/{path}``

Every route except the LFS ``PUT`` (a pre-signed storage URL on the real Hub) needs
``Authorization: Bearer <token>``; anything else gets 401 with the Hub's
``Invalid credentials in Authorization header``. ``fail_with = 401`` (or 403, 500)
answers every request with that status; ``fail_message`` then sets the error message, with
``{authorization}`` (the header received) and ``{token}`` (its bare token) filled in, as a
careless server or proxy might quote them. Unknown routes answer 404 and are listed in
``unknown`` so tests can assert that none was hit.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


@dataclass
class Repo:
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=dict)
    heads: dict[str, str] = field(default_factory=dict)
    commits: list[dict] = field(default_factory=list)


class StandInHub:
    """In-memory Hub on ``url``; ``received`` holds every file a commit added, by repo."""

    def __init__(self, token: str, user: str = "tester", role: str = "write"):
        self.token, self.user, self.role = token, user, role
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.lfs_patterns: tuple[str, ...] = ()
        self.fail_with: int | None = None
        self.fail_message: str | None = None
        self.requests: list[tuple[str, str]] = []
        self.unknown: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.validated_yaml: list[str] = []
        self.received: dict[str, dict[str, bytes]] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StandInHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        self.repos.clear()
        self.lfs_objects.clear()
        self.lfs_patterns = ()
        self.fail_with = None
        self.fail_message = None
        self.role = "write"
        for log in (self.requests, self.unknown, self.errors, self.validated_yaml):
            log.clear()
        self.received.clear()

    def add_repo(self, repo_id: str, files: dict[str, bytes] | None = None, private: bool = False) -> None:
        """A repo that already exists, as someone else (or an earlier push) left it."""
        repo = self.repos[repo_id] = Repo(private=private)
        repo.branches["main"] = {".gitattributes": GITATTRIBUTES, **(files or {})}
        repo.heads["main"] = _sha1(b"init" + repo_id.encode())

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo_id].branches[revision])

    def write(self, repo_id: str, directory: Path, revision: str = "main") -> Path:
        """Write the repo's files (as they are on ``revision``) into ``directory``."""
        for path, data in self.files(repo_id, revision).items():
            target = Path(directory) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return Path(directory)

    # -- routes -------------------------------------------------------------------------------

    def route(self, method: str, path: str, query: dict, body: bytes, headers) -> tuple[int, dict, object]:
        if self.fail_with:
            return _error(self.fail_with, "Forced failure", self._fail_message(headers))
        if method == "PUT" and path.startswith("/_lfs/"):
            return self._lfs_put(path[len("/_lfs/") :], body)
        if headers.get("authorization") != f"Bearer {self.token}":
            return _error(401, None, "Invalid credentials in Authorization header")
        table = [
            ("GET", r"/api/whoami-v2", self._whoami),
            ("POST", r"/api/repos/create", self._create),
            ("POST", r"/api/validate-yaml", self._validate_yaml),
            ("GET", rf"/api/models/{REPO}(/revision/(?P<rev>[^/]+))?", self._info),
            ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(/(?P<sub>.*))?", self._tree),
            ("POST", rf"/api/models/{REPO}/branch/(?P<branch>[^/]+)", self._branch),
            ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", self._preupload),
            ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", self._commit),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/batch", self._lfs_batch),
            ("GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self._resolve),
            ("HEAD", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self._resolve),
        ]
        for verb, pattern, handler in table:
            match = re.fullmatch(pattern, path)
            if verb == method and match:
                groups = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                is_json = headers.get("content-type", "").split(";")[0].endswith(("/json", "+json"))
                payload = json.loads(body) if body and is_json else body
                return handler(payload=payload, query=query, method=method, **groups)
        self.unknown.append((method, path))
        return _error(404, None, f"no route {method} {path}")

    def _fail_message(self, headers) -> str | None:
        if self.fail_message is None:
            return "Forbidden" if self.fail_with == 403 else None
        authorization = headers.get("authorization", "")
        return self.fail_message.format(authorization=authorization, token=authorization.removeprefix("Bearer "))

    def _whoami(self, **_):
        access = {"displayName": "test token", "role": self.role}
        return 200, {}, {"type": "user", "name": self.user, "auth": {"type": "access_token", "accessToken": access}}

    def _repo(self, repo: str, rev: str | None = None):
        if repo not in self.repos:
            return None, _error(404, "RepoNotFound", "Repository not found")
        if rev is not None and rev not in self.repos[repo].branches:
            return None, _error(404, "RevisionNotFound", "Invalid rev id")
        return self.repos[repo], None

    def _create(self, payload, **_):
        repo_id = f"{payload.get('organization') or self.user}/{payload['name']}"
        if repo_id.split("/")[0] != self.user:
            return _error(403, None, "You don't have the rights to create a model under this namespace")
        if repo_id in self.repos:
            return _error(409, None, "You already created this model repo")
        self.add_repo(repo_id, private=payload.get("visibility") == "private" or bool(payload.get("private")))
        return 200, {}, {"url": f"{self.url}/{repo_id}", "name": repo_id, "id": _sha1(repo_id.encode())[:24]}

    def _validate_yaml(self, payload, **_):
        self.validated_yaml.append(payload["content"])
        return 200, {}, {"errors": [], "warnings": []}

    def _info(self, repo, rev=None, **_):
        found, err = self._repo(repo, rev)
        if err:
            return err
        files = found.branches[rev or "main"]
        return 200, {}, {
            "id": repo, "author": repo.split("/")[0], "sha": found.heads[rev or "main"], "private": found.private,
            "siblings": [{"rfilename": p} for p in sorted(files)], "tags": [], "downloads": 0, "likes": 0,
        }  # fmt: skip

    def _tree(self, repo, rev, sub="", query=None, **_):
        found, err = self._repo(repo, rev)
        if err:
            return err
        prefix = sub.rstrip("/") + "/" if sub else ""
        entries = [
            {"type": "file", "oid": _sha1(data), "size": len(data), "path": p}
            for p, data in sorted(found.branches[rev].items())
            if p.startswith(prefix)
        ]
        return 200, {}, entries

    def _branch(self, repo, branch, payload, **_):
        found, err = self._repo(repo)
        if err:
            return err
        if branch in found.branches:
            return _error(409, None, "Reference already exists")
        start = (payload or {}).get("startingPoint") or "main"
        found.branches[branch] = dict(found.branches[start])
        found.heads[branch] = found.heads[start]
        return 200, {}, {}

    def _preupload(self, repo, rev, payload, **_):
        found, err = self._repo(repo, rev)
        if err:
            return err
        out = []
        for f in payload["files"]:
            lfs = any(fnmatch.fnmatch(f["path"], pat) for pat in self.lfs_patterns)
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False})
        return 200, {}, {"files": out, "commitOid": found.heads[rev]}

    def _lfs_batch(self, repo, payload, **_):
        if repo not in self.repos:
            return _error(404, "RepoNotFound", "Repository not found")
        objects = []
        for obj in payload["objects"]:
            item = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.lfs_objects:
                item["actions"] = {"upload": {"href": f"{self.url}/_lfs/{obj['oid']}"}}
            objects.append(item)
        return 200, {}, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, oid: str, body: bytes):
        if hashlib.sha256(body).hexdigest() != oid:
            return _error(400, None, "sha256 mismatch")
        self.lfs_objects[oid] = body
        return 200, {}, {}

    def _commit(self, repo, rev, payload, **_):
        found, err = self._repo(repo, rev)
        if err:
            return err
        files = dict(found.branches[rev])
        header, ops = None, []
        for line in payload.splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            ops.append(item)
            if key == "header":
                header = value
            elif key == "file":
                data = base64.b64decode(value["content"])
                files[value["path"]] = data
                self.received.setdefault(repo, {})[value["path"]] = data
            elif key == "lfsFile":
                if value["oid"] not in self.lfs_objects:
                    return _error(422, None, f"LFS object {value['oid']} was never uploaded")
                files[value["path"]] = self.lfs_objects[value["oid"]]
                self.received.setdefault(repo, {})[value["path"]] = self.lfs_objects[value["oid"]]
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key == "deletedFolder":
                files = {p: d for p, d in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            else:
                return _error(400, None, f"unknown commit operation {key!r}")
        found.branches[rev] = files
        found.heads[rev] = oid = _sha1(repr((time.time(), sorted(files))).encode())
        found.commits.append({"revision": rev, "header": header, "operations": ops})
        return 200, {}, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}

    def _resolve(self, repo, rev, file, method, **_):
        found, err = self._repo(repo, rev)
        if err:
            return err
        if file not in found.branches[rev]:
            return _error(404, "EntryNotFound", "Entry not found")
        data = found.branches[rev][file]
        headers = {"ETag": f'"{_sha1(data)}"', "X-Repo-Commit": found.heads[rev]}
        return 200, headers, data


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _error(status: int, code: str | None, message: str | None):
    headers = {k: v for k, v in (("X-Error-Code", code), ("X-Error-Message", message)) if v}
    return status, headers, {"error": message or "error"}


def _handler(hub: StandInHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output clean
            pass

        def _serve(self) -> None:
            parts = urlsplit(self.path)
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            hub.requests.append((self.command, parts.path))
            try:
                status, extra, payload = hub.route(self.command, parts.path, parse_qs(parts.query), body, headers)
            except Exception as err:  # a bug in the stand-in: answer 500 and keep it for the test to see
                hub.errors.append(repr(err))
                status, extra, payload = _error(500, None, "stand-in hub error")
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream" if isinstance(payload, bytes) else
                             "application/json")  # fmt: skip
            self.send_header("Content-Length", str(len(data)))
            for key, value in extra.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_HEAD = _serve

    return Handler
