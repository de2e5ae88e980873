"""An OpenAI-compatible ``/v1/chat/completions`` endpoint in front of the rollout engine, token in / token out.

    endpoint = AgentEndpoint(sessions_owner)          # grpo.episodes.agent.AgentEngine; serves on 127.0.0.1
    session = endpoint.open(prompt_index, number, first_seed, sampling)
    client = openai.OpenAI(base_url=endpoint.base_url, default_headers={SESSION_HEADER: session.id}, api_key="-")
    ...                                               # the agent's own loop: client.chat.completions.create(...)
    endpoint.end(session)                             # session.episode: an `Episode`, as the tool loop builds one

A session is one episode, named by the ``X-Session-Id`` header (the client handed to the agent sets it). Its first
request's messages are rendered as a prompt is (the chat template with the request's ``tools``, the generation
header); every later request must repeat the session's history exactly (its messages so far, the assistant messages
as the endpoint returned them) and add new ``tool`` (and ``user``) messages, which are rendered alone after the last
sampled turn (the tool loop's tool-suffix rule, `Renderer.tool_suffix_ids`) and appended to the session's ids. An
assistant turn is never rendered again: the ids the engine sampled stay the episode's. A request that drops, edits
or summarises an earlier message is refused (400, ``history_rewritten``, naming the first message that differs);
nothing is re-tokenized. Turns are sampled with the rollout's settings (the request's temperature, max_tokens, ...
are ignored), at most what is left of max_completion_length, each seeded as the tool loop seeds a later turn
(`turn_seed`); each token keeps its engine log-prob and (server) the weight version that sampled it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from grpo.episodes.formats import Renderer
from grpo.episodes.loop import Episode, turn_seed

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_REQUEST_BYTES = 16 * 1024 * 1024
ENDED_REMEMBERED = 100_000  # ended sessions told apart from unknown ones (older ones are unknown: a 404)


class Refused(Exception):
    """A request the endpoint answers with an OpenAI-style error (``{"error": {message, type, param, code}}``)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class AgentSession:
    """One agent episode: the messages it has sent and been sent, and its ids (`episode`, from the first turn)."""

    id: str
    prompt_index: int
    number: int  # its place among the rollout's episodes (seeds its turns: `turn_seed`)
    first_seed: int | None  # its prompt's first-turn seed on a server; None on the colocated engine (unseeded)
    sampling: object  # the rollout's SamplingParams
    episode: Episode | None = None
    messages: list[dict] = field(default_factory=list)  # the history, normalized (`normalized`)
    tools: list | None = None  # the first request's tools: the prompt was rendered with them
    renderer: Renderer | None = None
    call_names: dict[str, str] = field(default_factory=dict)  # tool_call_id -> function name
    requests: list = field(default_factory=list)  # its rollout's requests so far (`PendingEpisodes.turns`)
    refusals: int = 0  # requests refused for a rewritten history
    engine_error: BaseException | None = None  # the engine failed a turn (the server gone): the rollout's failure
    ended: str | None = None  # why no more turns are served
    at_limit: bool = False  # ended at max_completion_length or max_tool_calling_iterations: a finished episode
    lock: threading.Lock = field(default_factory=threading.Lock)


def text_content(content, where: str) -> str:
    """A message's content as text: a string, null, or a list of ``{"type": "text", "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise Refused(400, f"{where}.content must be a string or a list of text parts, not {content!r:.80}", "bad_content")


def call_arguments(arguments, where: str) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise Refused(400, f"{where}.function.arguments is not a JSON object: {arguments!r:.80}", "bad_tool_call")
    return value


def normalized(message, index: int) -> dict:
    """What of an OpenAI chat message the history holds (role, text, tool calls as (id, name, arguments), the
    tool_call_id): the fields an agent's client may add or drop (refusal, annotations, a null content) aside."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        role = message.get("role") if isinstance(message, dict) else message
        raise Refused(400, f"{where} has role {role!r:.40}; the roles are {list(ROLES)}", "bad_role", where)
    out = {"role": message["role"], "content": text_content(message.get("content"), where)}
    if message["role"] == "assistant":
        calls = []
        for k, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise Refused(400, f"{where}.tool_calls[{k}] has no function name", "bad_tool_call", where)
            arguments = call_arguments(function.get("arguments"), f"{where}.tool_calls[{k}]")
            calls.append((call.get("id"), function["name"], arguments))
        out["tool_calls"] = calls
    if message["role"] == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def template_message(message: dict, call_names: dict[str, str]) -> dict:
    """A normalized message as the chat template takes it (TRL's and the tool loop's shapes)."""
    role = "system" if message["role"] == "developer" else message["role"]
    if role == "assistant":
        calls = [{"type": "function", "function": {"name": n, "arguments": a}} for _, n, a in message["tool_calls"]]
        return {"role": role, "content": message["content"], **({"tool_calls": calls} if calls else {})}
    if role == "tool":
        return {"role": role, "name": call_names.get(message["tool_call_id"], "tool"), "content": message["content"]}
    return {"role": role, "content": message["content"]}


def first_difference(history: list[dict], sent: list[dict]) -> int | None:
    """The index of the first message of the history that ``sent`` does not repeat, or None."""
    for index, message in enumerate(history):
        if index >= len(sent) or sent[index] != message:
            return index
    return None


class EndpointServer(ThreadingHTTPServer):
    daemon_threads = True
    # every agent of a rollout may connect at once: socketserver's backlog of 5 would refuse connections under load
    request_queue_size = 1024


class AgentEndpoint:
    """The endpoint's sessions and its HTTP server (a daemon thread; one thread per connection)."""

    def __init__(self, owner, host: str = "127.0.0.1", port: int = 0):
        # owner: tokenizer, template_kwargs, max_completion_length, max_iterations, _room, _after_turn, _generate_turn
        self.owner = owner
        self.sessions: dict[str, AgentSession] = {}
        self.ended_ids: OrderedDict[str, None] = OrderedDict()  # the latest ENDED_REMEMBERED, for a 409 over a 404
        self.lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 - http.server's name
                endpoint.handle(self)

            def log_message(self, format, *args):  # noqa: A002 - http.server's signature
                log.debug("agent endpoint: " + format, *args)

        self.server = EndpointServer((host, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True, name="agent-endpoint").start()
        self.base_url = f"http://{host}:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ sessions
    def open(self, prompt_index: int, number: int, first_seed: int | None, sampling, requests: list) -> AgentSession:
        session = AgentSession(uuid.uuid4().hex, prompt_index, number, first_seed, sampling, requests=requests)
        with self.lock:
            self.sessions[session.id] = session
        return session

    def end(self, session: AgentSession, why: str = "its episode has ended") -> AgentSession:
        """No more turns for the session (a request in flight finishes first); later requests get 409."""
        with session.lock:
            session.ended = session.ended or why
        with self.lock:
            self.sessions.pop(session.id, None)
            self.ended_ids[session.id] = None
            if len(self.ended_ids) > ENDED_REMEMBERED:
                self.ended_ids.popitem(last=False)
        return session

    # ------------------------------------------------------------------ HTTP
    def handle(self, request: BaseHTTPRequestHandler) -> None:
        try:
            if request.path.rstrip("/") != "/v1/chat/completions":
                raise Refused(
                    404, f"no route {request.path!r}: this endpoint serves POST /v1/chat/completions", "no_route"
                )
            length = int(request.headers.get("Content-Length") or 0)
            if length > MAX_REQUEST_BYTES:
                raise Refused(413, f"request of {length} bytes, over {MAX_REQUEST_BYTES}", "request_too_large")
            try:
                body = json.loads(request.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise Refused(400, f"the request body is not JSON: {err}", "bad_json") from None
            status, reply = 200, self.complete(request.headers.get(SESSION_HEADER), body)
        except Refused as refused:
            status, reply = refused.status, refused.body()
        except Exception as err:  # noqa: BLE001 - an engine failure is this request's 500, not the server's end
            log.warning("agent endpoint: %s: %s", type(err).__name__, err)
            status, reply = 500, Refused(500, f"{type(err).__name__}: {err}", "engine_error").body()
        data = json.dumps(reply).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def session_of(self, session_id: str | None) -> AgentSession:
        if not session_id:
            raise Refused(
                400, f"no session: send the {SESSION_HEADER} header of the client you were given", "no_session"
            )
        with self.lock:
            session = self.sessions.get(session_id)
            ended = session_id in self.ended_ids
        if session is None:
            if ended:
                raise Refused(409, f"session {session_id!r} has ended: its episode was collected", "session_ended")
            raise Refused(404, f"unknown session {session_id!r} ({SESSION_HEADER})", "unknown_session")
        return session

    def complete(self, session_id: str | None, body) -> dict:
        session = self.session_of(session_id)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise Refused(400, "the request needs a non-empty list of messages", "bad_messages", "messages")
        if body.get("stream"):
            raise Refused(400, "stream=true is not served: ask without streaming", "no_streaming", "stream")
        if body.get("n", 1) != 1:
            raise Refused(400, f"n={body['n']!r}: a session samples one completion per turn", "bad_n", "n")
        sent = [normalized(m, i) for i, m in enumerate(body["messages"])]
        with session.lock:
            if session.ended:
                raise Refused(409, f"session {session.id!r} has ended: {session.ended}", "session_ended")
            new = self.new_messages(session, sent, body.get("tools"))
            return self.turn(session, sent, new, body.get("tools"), body.get("model") or "policy")

    def new_messages(self, session: AgentSession, sent: list[dict], tools) -> list[dict]:
        """The messages ``sent`` adds to the session's history; a rewritten history is refused."""
        if session.episode is not None:
            differs = first_difference(session.messages, sent)
            if differs is None and tools != session.tools:
                differs, what = len(session.messages), "the tools differ from the first request's"
            elif differs is not None:
                got = json.dumps(sent[differs], default=str)[:200] if differs < len(sent) else "nothing"
                want = json.dumps(session.messages[differs], default=str)[:200]
                what = f"messages[{differs}] is {got}, the session's history holds {want}"
            if differs is not None:
                session.refusals += 1
                raise Refused(
                    400,
                    f"session {session.id!r}: the request's messages are not the session's history plus new messages: "
                    f"{what}. The sampled tokens of earlier turns are the episode's; send the history unchanged "
                    "(the assistant messages as this endpoint returned them) and add only new messages",
                    "history_rewritten",
                    f"messages[{differs}]",
                )
        new = sent[len(session.messages) :]
        if not new:
            raise Refused(400, "no new message after the session's history", "no_new_message", "messages")
        if session.episode is not None:
            for offset, message in enumerate(new):
                index = len(session.messages) + offset
                if message["role"] not in ("tool", "user"):
                    raise Refused(
                        400,
                        f"messages[{index}] has role {message['role']!r}: after a sampled turn an agent adds tool "
                        "or user messages (an assistant message the endpoint did not sample is a rewritten history)",
                        "bad_role",
                        f"messages[{index}]",
                    )
                if message["role"] == "tool" and message["tool_call_id"] not in session.call_names:
                    raise Refused(
                        400,
                        f"messages[{index}].tool_call_id={message['tool_call_id']!r} names no tool call of this "
                        f"session (its calls: {sorted(session.call_names)})",
                        "unknown_tool_call",
                        f"messages[{index}]",
                    )
        if new[-1]["role"] == "assistant":
            raise Refused(400, "the last message is an assistant message: nothing to answer", "bad_role", "messages")
        return new

    def turn(self, session: AgentSession, sent: list[dict], new: list[dict], tools, model: str) -> dict:
        """Append the new messages' ids, sample one turn, answer it in OpenAI's shape."""
        owner = self.owner
        if session.episode is None:  # the first request: its messages are the prompt, rendered as a prompt is
            if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise Refused(
                    400, f"tools must be a list of OpenAI function tools, not {tools!r:.80}", "bad_tools", "tools"
                )
            session.tools = tools
            session.renderer = Renderer(owner.tokenizer, tools or [], owner.template_kwargs)
            for message in sent:
                for call_id, name, _ in message.get("tool_calls", []):
                    session.call_names[call_id] = name
            conversation = [template_message(m, session.call_names) for m in sent]
            with owner.tokenizing:
                prompt = session.renderer.prompt_ids(conversation)
            session.episode = Episode(prompt, session.prompt_index, number=session.number)
        else:
            episode = session.episode
            if owner.max_iterations is not None and len(episode.turns) > owner.max_iterations:
                self._end(session, f"max_tool_calling_iterations={owner.max_iterations} reached", at_limit=True)
                raise Refused(400, f"session {session.id!r}: {session.ended}", "turn_limit")
            with owner.tokenizing:
                suffix = session.renderer.tool_suffix_ids([template_message(m, session.call_names) for m in new])
            episode.tool_calls += sum(m["role"] == "tool" for m in new)
            if len(episode.completion_ids) + len(suffix) > owner.max_completion_length:  # dropped, as TRL drops it
                self._end(session, f"max_completion_length={owner.max_completion_length} reached", at_limit=True)
                raise Refused(400, f"session {session.id!r}: {session.ended}", "context_length_exceeded")
            episode.add_tool_tokens(suffix)
            if len(episode.completion_ids) == owner.max_completion_length:
                episode.truncated = True
                self._end(session, f"max_completion_length={owner.max_completion_length} reached", at_limit=True)
                raise Refused(400, f"session {session.id!r}: {session.ended}", "context_length_exceeded")
        episode = session.episode
        number = len(episode.turns) + 1
        seed = None if session.first_seed is None else turn_seed(session.first_seed, session.number, number)
        budget = owner._room(episode)  # the tool loop's: no request asks for more than the engine's context holds
        history = len(episode.prompt_ids) + len(episode.completion_ids)
        if budget < owner.min_turn_tokens:
            episode.truncated = True
            left = f"{history} tokens leave {budget} of max_model_len={owner.max_model_len}"
            self._end(
                session, f"{left}, fewer than tool_calling.min_turn_tokens={owner.min_turn_tokens}", at_limit=True
            )
            raise Refused(400, f"session {session.id!r}: {session.ended}", "context_length_exceeded")
        request = episode.prompt_ids + episode.completion_ids
        try:
            sample = owner._generate_turn(session, request, budget, seed)
        except Exception as err:
            session.engine_error = err  # raised by the rollout once its agents have ended, as the tool loop raises it
            self._end(session, f"the engine failed: {type(err).__name__}: {err}")
            raise
        owner._after_turn(episode, sample, request)
        turn_ids, calls, ended = episode.turns[-1]
        malformed = sum(isinstance(c, str) for c in calls)
        episode.tool_calls += malformed  # no result comes back for these: each counts as a failed call
        episode.tool_failures += malformed
        episode.tool_malformed += malformed
        with owner.tokenizing:
            reply = owner.renderer.assistant_message(turn_ids, calls)
        tool_calls = [
            {
                "id": f"call_{session.id[:8]}_{number}_{k}",
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
            }
            for k, c in enumerate(reply.get("tool_calls", []))
        ]
        session.call_names = {c["id"]: c["function"]["name"] for c in tool_calls}
        message = {"role": "assistant", "content": reply["content"], "tool_calls": tool_calls or None}
        session.messages = sent + [normalized(message, len(sent))]
        finish = "tool_calls" if tool_calls else ("stop" if ended else "length")
        return {
            "id": f"chatcmpl-{session.id[:8]}-{number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(episode.prompt_ids) + len(episode.completion_ids) - len(turn_ids),
                "completion_tokens": len(turn_ids),
                "total_tokens": len(episode.prompt_ids) + len(episode.completion_ids),
            },
        }

    def _end(self, session: AgentSession, why: str, at_limit: bool = False) -> None:
        session.ended = session.ended or why  # under session.lock (the caller holds it)
        session.at_limit = session.at_limit or at_limit
