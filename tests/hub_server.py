"""A local stand-in for the Hugging Face Hub: the part of its HTTP API that an upload and a streamed dataset use.

Serves on 127.0.0.1 (port chosen by the OS), for tests that point `HF_ENDPOINT` at it and run the
real huggingface_hub client:
  GET  /api/whoami-v2                                  the token's user (401 for unknown tokens)
  POST /api/repos/create                               new repo with an initial .gitattributes commit
  POST /api/validate-yaml                              checks a README's metadata, model-index included
  GET  /api/models/<repo>[/revision/<rev>]             model info (sha, private, siblings)
  POST /api/models/<repo>/preupload/<rev>              always "regular": files travel inline
  POST /api/models/<repo>/commit/<rev>                 NDJSON commit (file, deletedFile, deletedFolder)
  POST /api/models/<repo>/branch/<branch>              create a branch
  GET  /api/models/<repo>/refs                         branches
  GET  /api/models/<repo>/tree/<rev>[/<path>]          files and folders
  GET|HEAD /<repo>/resolve/<rev>/<path>                file content, with X-Repo-Commit and ETag
Dataset repos (seeded by `add_dataset`; what HfFileSystem reads, `hf://datasets/<repo>/...`):
  GET  /api/datasets/<repo>[/revision/<rev>]           dataset info (sha, private, siblings)
  GET  /api/datasets/<repo>/tree/<rev>[/<path>]        files and folders, `tree_page_size` a page (Link: next)
  POST /api/datasets/<repo>/paths-info/<rev>           the entries of the form's `paths` that exist
  GET|HEAD /datasets/<repo>/resolve/<rev>/<path>       file content; a Range header gives 206 and that range
Like the Hub it answers 401 to an unknown token, 404 for a private repo the caller cannot see,
and 403 to writes (create, preupload, commit, branch) in a namespace that is neither the user's
nor one of the user's organisations, or with a read-only token. Every commit, with the whole file
tree after it, stays in memory for tests to inspect. `refuse_commits` makes commits fail with 403;
clearing `commits_open` holds them until it is set. A route named in `silent` (its handler's name: "whoami",
"commit", ...) gets no answer: the request is held until the name leaves `silent`, then its connection is closed;
`fail_next` maps a route to the statuses its next requests get instead of an answer (a one-off 503: [503]).

Not supported: LFS/Xet uploads (preupload never asks for them), pull requests, tags, copies,
pagination of model trees, writes to datasets, spaces, deleting repos.
"""

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(content: bytes) -> str:
    """The git object id of a file, which the Hub reports as a regular file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class User:
    name: str
    orgs: list[str] = field(default_factory=list)
    role: str = "write"  # "read" tokens may not write anything

    def can_write(self, namespace: str) -> bool:
        return self.role != "read" and namespace in (self.name, *self.orgs)

    def can_read(self, namespace: str) -> bool:
        return namespace in (self.name, *self.orgs)


@dataclass
class Commit:
    oid: str
    summary: str
    parent: str | None
    files: dict[str, bytes]  # the whole tree after this commit
    added: dict[str, bytes]  # what this commit added or replaced
    deleted: list[str]


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)  # by oid, every branch
    branches: dict[str, str] = field(default_factory=dict)  # branch name -> head oid
    kind: str = "model"  # or "dataset"

    @property
    def namespace(self) -> str:
        return self.repo_id.split("/")[0]

    def resolve(self, revision: str) -> Commit | None:
        return self.commits.get(self.branches.get(revision, revision))

    def history(self, branch: str = "main") -> list[Commit]:
        """The commits of a branch, oldest first."""
        commits, oid = [], self.branches[branch]
        while oid:
            commits.append(self.commits[oid])
            oid = self.commits[oid].parent
        return commits[::-1]

    def add_commit(self, branch: str, summary: str, added: dict[str, bytes], deleted: list[str]) -> Commit:
        parent = self.resolve(branch) if branch in self.branches else None
        files = dict(parent.files) if parent else {}
        for path in deleted:  # a path deletes the file or everything below the folder
            files = {p: c for p, c in files.items() if p != path and not p.startswith(path.rstrip("/") + "/")}
        files.update(added)
        digest = hashlib.sha1(f"{parent.oid if parent else ''}\n{summary}\n{len(self.commits)}".encode())
        for path in sorted(files):
            digest.update(path.encode() + git_blob_sha1(files[path]).encode())
        commit = Commit(digest.hexdigest(), summary, parent.oid if parent else None, files, added, deleted)
        self.commits[commit.oid] = commit
        self.branches[branch] = commit.oid
        return commit


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class HubServer:
    """The server and its state. `users` maps each valid token to its user."""

    def __init__(self, users: dict[str, User]):
        self.users = users
        self.repos: dict[str, Repo] = {}  # model repos
        self.datasets: dict[str, Repo] = {}  # dataset repos
        self.tree_page_size = 1000  # entries per page of a dataset's tree listing, as the Hub's
        self.refuse_commits: str | None = None  # a message: commits then fail with 403
        self.commits_open = threading.Event()  # clear it to hold every commit until it is set again
        self.commits_open.set()
        self.silent: set[str] = set()  # routes that do not answer while named here
        self.fail_next: dict[str, list[int]] = {}  # route: the statuses its next requests get, one each
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.ranges: list[tuple[str, int, int]] = []  # (file, first byte, last byte) of every ranged read
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def history(self, repo_id: str, branch: str = "main") -> list[Commit]:
        with self.lock:
            return self.repos[repo_id].history(branch)

    def add_dataset(self, repo_id: str, files: dict[str, bytes], private: bool = False) -> Commit:
        """A dataset repo whose main branch holds `files` (one commit); a later call commits on top of it."""
        with self.lock:
            repo = self.datasets.setdefault(repo_id, Repo(repo_id, private, kind="dataset"))
            return repo.add_commit("main", "add files", files, [])

    # ---------------------------------------------------------------- the API, one method per route

    def whoami(self, user: User) -> dict:
        return {
            "type": "user",
            "id": user.name,
            "name": user.name,
            "fullname": user.name.title(),
            "orgs": [{"type": "org", "name": org, "roleInOrg": "write"} for org in user.orgs],
            "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": user.role}},
        }

    def create_repo(self, user: User, body: dict) -> tuple[int, dict]:
        if body.get("type", "model") != "model":
            raise HttpError(400, "this test server only hosts model repos")
        namespace = body.get("organization") or user.name
        repo_id = f"{namespace}/{body['name']}"
        if not user.can_write(namespace):
            raise HttpError(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
        private = body.get("visibility") == "private" or bool(body.get("private"))
        repo = self.repos[repo_id] = Repo(repo_id, private)
        repo.add_commit("main", "initial commit", {".gitattributes": GITATTRIBUTES}, [])
        return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id, "id": repo_id}

    def validate_yaml(self, body: dict) -> tuple[int, dict]:
        errors = card_metadata_errors(body.get("content", ""))
        return (400 if errors else 200), {"errors": [{"message": e} for e in errors], "warnings": []}

    def model_info(self, repo: Repo, revision: str) -> dict:
        commit = self.revision(repo, revision)
        return {
            "id": repo.repo_id,
            **({"modelId": repo.repo_id} if repo.kind == "model" else {}),
            "author": repo.namespace,
            "sha": commit.oid,
            "private": repo.private,
            "disabled": False,
            "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        }

    def preupload(self, repo: Repo, revision: str, body: dict) -> dict:
        commit = self.revision(repo, revision)
        return {
            "commitOid": commit.oid,
            "files": [
                {
                    "path": f["path"],
                    "uploadMode": "regular",
                    "shouldIgnore": False,
                    "oid": git_blob_sha1(commit.files[f["path"]]) if f["path"] in commit.files else None,
                }
                for f in body["files"]
            ],
        }

    def commit(self, repo: Repo, revision: str, ndjson: bytes) -> dict:
        if self.refuse_commits:
            raise HttpError(403, self.refuse_commits)
        if revision not in repo.branches:
            raise HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        header, added, deleted = {}, {}, []
        for line in ndjson.splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file" and value.get("encoding") == "base64":
                added[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            else:
                raise HttpError(400, f"this test server does not take {key!r} operations")
        if header.get("parentCommit") and header["parentCommit"] != repo.branches[revision]:
            raise HttpError(412, "A commit has happened since the parent commit")
        commit = repo.add_commit(revision, header.get("summary", ""), added, deleted)
        return {
            "commitUrl": f"{self.url}/{repo.repo_id}/commit/{commit.oid}",
            "commitOid": commit.oid,
            "pullRequestUrl": None,
        }

    def create_branch(self, repo: Repo, branch: str, body: dict) -> tuple[int, dict]:
        if branch in repo.branches:
            return 409, {"error": f"Reference already exists: refs/heads/{branch}"}
        repo.branches[branch] = self.revision(repo, body.get("startingPoint") or "main").oid
        return 200, {}

    def refs(self, repo: Repo) -> dict:
        return {
            "branches": [
                {"name": name, "ref": f"refs/heads/{name}", "targetCommit": oid} for name, oid in repo.branches.items()
            ],
            "tags": [],
            "converts": [],
        }

    def tree(self, repo: Repo, revision: str, path: str, recursive: bool) -> list[dict]:
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        entries = {}
        for file, content in self.revision(repo, revision).files.items():
            if not file.startswith(prefix):
                continue
            parts = file[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                folder = prefix + "/".join(parts[:depth])
                entries[folder] = {"type": "directory", "path": folder, "oid": "0" * 40, "size": 0}
            if recursive or len(parts) == 1:
                entries[file] = {"type": "file", "path": file, "oid": git_blob_sha1(content), "size": len(content)}
        if prefix and not entries:
            raise HttpError(404, f"{path} does not exist", "EntryNotFound")
        return list(entries.values())

    def tree_page(self, repo: Repo, revision: str, path: str, recursive: bool, cursor: int) -> tuple[list, bool]:
        """A dataset tree from entry `cursor` on, a page long; and whether more follows."""
        entries = self.tree(repo, revision, path, recursive)
        return entries[cursor : cursor + self.tree_page_size], cursor + self.tree_page_size < len(entries)

    def paths_info(self, repo: Repo, revision: str, paths: list[str]) -> list[dict]:
        files = self.revision(repo, revision).files
        found = []
        for path in (p.strip("/") for p in paths):
            if path in files:
                found.append(
                    {"type": "file", "path": path, "oid": git_blob_sha1(files[path]), "size": len(files[path])}
                )
            elif any(f.startswith(path + "/") for f in files):
                found.append({"type": "directory", "path": path, "oid": "0" * 40, "size": 0})
        return found

    def revision(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit


def card_metadata_errors(content: str) -> list[str]:
    """What the Hub would reject in a model card's YAML block (the checks an upload relies on)."""
    match = re.match(r"^---\n(.*?)\n---\n", content, re.DOTALL)
    if not match:
        return []  # no metadata is allowed (the Hub only warns)
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as err:
        return [f"invalid YAML: {err}"]
    if not isinstance(meta, dict):
        return ["metadata must be a mapping"]
    errors = [
        f"{key} must be a string or a list of strings"
        for key in ("tags", "datasets", "base_model", "metrics")
        if key in meta
        and not (
            isinstance(meta[key], str) or (isinstance(meta[key], list) and all(isinstance(v, str) for v in meta[key]))
        )
    ]
    errors += [
        f"{key} must be a string"
        for key in ("license", "library_name", "pipeline_tag")
        if key in meta and not isinstance(meta[key], str)
    ]
    for model in meta.get("model-index", []) if isinstance(meta.get("model-index", []), list) else [None]:
        try:
            assert isinstance(model["name"], str)
            for result in model["results"]:
                assert isinstance(result["task"]["type"], str)
                assert isinstance(result["dataset"]["type"], str) and isinstance(result["dataset"]["name"], str)
                assert all(isinstance(m["type"], str) and "value" in m for m in result["metrics"])
        except (AssertionError, KeyError, TypeError):
            errors.append(
                "model-index: each entry needs name and results with task.type, dataset.type, "
                "dataset.name and metrics (type, value)"
            )
    return errors


REPO = r"(?P<repo>[^/]+/[^/]+)"
DATASET = r"(?P<kind>datasets)/(?P<repo>[^/]+/[^/]+)"
ROUTES = [  # (method, pattern, handler name); methods are matched in order
    ("GET", rf"/api/{DATASET}(?:/revision/(?P<rev>[^/]+))?", "model_info"),
    ("GET", rf"/api/{DATASET}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
    ("POST", rf"/api/{DATASET}/paths-info/(?P<rev>[^/]+)", "paths_info"),
    ("GET", rf"/{DATASET}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
    ("GET", r"/api/whoami-v2", "whoami"),
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("GET", rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", "model_info"),
    ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("POST", rf"/api/models/{REPO}/branch/(?P<rev>[^/]+)", "create_branch"),
    ("GET", rf"/api/models/{REPO}/refs", "refs"),
    ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
    ("GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]
WRITES = {"create_repo", "preupload", "commit", "create_branch"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        body = self._body()
        self.hub.requests.append((method, url.path))
        try:
            for route_method, pattern, name in ROUTES:
                match = re.fullmatch(pattern, url.path)
                if match and (route_method == method or (name == "resolve" and method == "HEAD")):
                    if name in self.hub.silent:
                        return self._say_nothing(name)
                    if failing := self.hub.fail_next.get(name):
                        status = failing.pop(0)
                        raise HttpError(status, f"the test Hub answers {status} this time")
                    if name == "commit":
                        self.hub.commits_open.wait(timeout=60)
                    with self.hub.lock:
                        self._route(
                            name,
                            {k: unquote(v) for k, v in match.groupdict().items() if v},
                            body,
                            parse_qs(url.query),
                            head=method == "HEAD",
                        )
                    return
            raise HttpError(404, f"{method} {url.path} is not served by the test Hub")
        except HttpError as err:
            self._send(err.status, {"error": err.message}, error=err)

    def _say_nothing(self, name: str) -> None:
        """No answer while `name` is silent (a minute at most); then the connection is closed, still unanswered."""
        for _ in range(1200):
            if name not in self.hub.silent:
                break
            time.sleep(0.05)
        self.close_connection = True

    def _route(self, name: str, args: dict, body: bytes, query: dict, head: bool) -> None:
        user = self._user()
        if name == "whoami":
            return self._send(200, self.hub.whoami(self._need(user)))
        if name == "create_repo":
            return self._send(*self.hub.create_repo(self._need(user), json.loads(body)))
        if name == "validate_yaml":
            return self._send(*self.hub.validate_yaml(json.loads(body)))
        repo = self._visible_repo(args["repo"], user, args.get("kind") == "datasets")
        if name in WRITES and not self._need(user).can_write(repo.namespace):
            raise HttpError(403, f"You don't have the rights to write to {repo.repo_id}")
        rev = args.get("rev", "main")
        if name == "model_info":
            self._send(200, self.hub.model_info(repo, rev))
        elif name == "preupload":
            self._send(200, self.hub.preupload(repo, rev, json.loads(body)))
        elif name == "commit":
            self._send(200, self.hub.commit(repo, rev, body))
        elif name == "create_branch":
            self._send(*self.hub.create_branch(repo, rev, json.loads(body or b"{}")))
        elif name == "refs":
            self._send(200, self.hub.refs(repo))
        elif name == "tree" and args.get("kind"):  # a dataset's tree comes in pages, as the Hub's
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            cursor = int(query.get("cursor", ["0"])[0])
            page, more = self.hub.tree_page(repo, rev, args.get("path", ""), recursive, cursor)
            after = f"{self.hub.url}{urlsplit(self.path).path}?recursive={recursive}&cursor={cursor + len(page)}"
            self._send(200, page, link=f'<{after}>; rel="next"' if more else None)
        elif name == "tree":
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            self._send(200, self.hub.tree(repo, rev, args.get("path", ""), recursive))
        elif name == "paths_info":
            self._send(200, self.hub.paths_info(repo, rev, parse_qs(body.decode()).get("paths", [])))
        elif name == "resolve":
            self._send_file(repo, self.hub.revision(repo, rev), args["path"], head)

    def _user(self) -> User | None:
        auth = self.headers.get("Authorization", "")
        if not auth:
            return None
        user = self.hub.users.get(auth.removeprefix("Bearer ").strip())
        if user is None:
            raise HttpError(401, "Invalid credentials in Authorization header")
        return user

    @staticmethod
    def _need(user: User | None) -> User:
        if user is None:
            raise HttpError(401, "Invalid credentials in Authorization header")
        return user

    def _visible_repo(self, repo_id: str, user: User | None, dataset: bool = False) -> Repo:
        repo = (self.hub.datasets if dataset else self.hub.repos).get(repo_id)
        if repo is None:
            raise HttpError(404, "Repository not found", "RepoNotFound")
        # a private dataset is read with any token of its namespace; a private model still needs a write token
        allowed = user and (user.can_read(repo.namespace) if dataset else user.can_write(repo.namespace))
        if repo.private and not allowed:
            raise HttpError(404, "Repository not found", "RepoNotFound")
        return repo

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, payload, error: HttpError | None = None, link: str | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if link:
            self.send_header("Link", link)
        if error is not None:
            self.send_header("X-Error-Message", error.message)
            if error.code:
                self.send_header("X-Error-Code", error.code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_file(self, repo: Repo, commit: Commit, path: str, head: bool) -> None:
        if path not in commit.files:
            raise HttpError(404, f"{path} does not exist in {repo.repo_id}", "EntryNotFound")
        content, size = commit.files[path], len(commit.files[path])
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "").strip())
        if ranged and int(ranged.group(1)) >= size:
            raise HttpError(416, f"range not satisfiable for {size} bytes")
        self.send_response(206 if ranged else 200)
        if ranged:  # a ranged read, as HfFileSystem's files make them: bytes first-last, both included
            first, last = int(ranged.group(1)), min(int(ranged.group(2) or size - 1), size - 1)
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            content = content[first : last + 1]
            self.hub.ranges.append((path, first, last))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("X-Repo-Commit", commit.oid)
        self.send_header("ETag", f'"{git_blob_sha1(commit.files[path])}"')
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if not head:
            self.wfile.write(content)
