"""The server's request handler: mlx-lm's (its completions, streaming, tools,
logprobs), behind kvarn_mlx.guard's rules, with every completion request's
fields checked before it is queued, the model names and list of
served_models, and GET /v1/kv_stats.

Its collaborators come in as arguments, as mlx-lm passes its generator:
`lambda *a, **k: APIHandler(generator, stats, settings, *a, **k)`.
"""

import io
import json
import logging
from urllib.parse import parse_qs, unquote, urlsplit

import mlx_lm.server as mlx_server

from .. import guard
from ..config import DEFAULT_PRESET, FP16, user_preset
from ..integration import profile_mix
from ..profile import from_settings
from .http_io import check_request, parse_json, read_body, send_error, send_json
from .request_fields import check as check_fields
from .served_models import find_model, model_for, model_list, names, served_id

STATS_PATH = "/v1/kv_stats"
MODELS_PATH = "/v1/models"
COMPLETIONS = {
    "/v1/completions": False,
    "/v1/chat/completions": True,
    "/chat/completions": True,
}  # path: chat?


class APIHandler(mlx_server.APIHandler):
    """mlx-lm's request handler behind kvarn_mlx.guard's checks, plus the model
    list and the stats endpoint. stats: the server's stats.KVStats; settings:
    its flags (cli.arg_parser's: allowed_hosts, allowed_origins, api_key,
    kv_preset, kv_sink, kv_tail_tokens, model as given, started)."""

    reply_model = None  # the model a reply names: as the request did

    def __init__(self, response_generator, stats, settings, *args, **kwargs):
        self.stats, self.settings = stats, settings
        super().__init__(response_generator, *args, **kwargs)  # handles the request

    def refused(self, post, public=False):
        """Answer and return True if the request breaks a rule of kvarn_mlx.guard."""
        try:
            check_request(self, self.settings, post, public)
        except guard.Refused as e:
            send_error(self, e)
            return True
        return False

    def send_json(self, data, status=200):
        send_json(self, data, status, self.settings.allowed_origins)

    # -- completions (POST) --------------------------------------------------------------

    def do_POST(self):
        if self.refused(post=True):
            return
        try:
            body = read_body(self)
            if self.path in COMPLETIONS:
                body = self.check_completion(body, chat=COMPLETIONS[self.path])
        except guard.Refused as e:
            return send_error(self, e)
        rfile, self.rfile = self.rfile, io.BytesIO(body)  # mlx-lm reads the body again
        self.headers.replace_header("Content-Length", str(len(body)))  # check_completion rewrote it
        try:
            super().do_POST()
        finally:
            self.rfile = rfile

    def check_completion(self, body, chat):
        """The completion request's body, parsed (http_io.parse_json), its fields
        checked (request_fields) and its "model" the name mlx-lm loads:
        "default_model" for the served model (served_models.model_for)."""
        data = check_fields(parse_json(body), chat=chat)
        self.reply_model = data.get("model") or self.served_model()
        data["model"] = model_for(data.get("model"), self.served_model(), self.model_names())
        return json.dumps(data).encode()

    def handle_completion(self, request, stop_words):
        self.response_generator = PromptRecorder(
            self.response_generator, self.stats, self.request_id
        )
        try:
            super().handle_completion(request, stop_words)
        except (BrokenPipeError, ConnectionResetError):  # mlx-lm stops the generation; no traceback
            logging.info(f"{self.request_id}: the client left before the reply was sent")
            self.close_connection = True

    def generate_response(self, *args, **kwargs):
        return self._named(super().generate_response(*args, **kwargs))

    def completion_usage_response(self, *args, **kwargs):
        return self._named(super().completion_usage_response(*args, **kwargs))

    def _named(self, response):
        """A reply naming the model as the request did (mlx-lm's: "default_model")."""
        if self.reply_model is not None:
            response["model"] = self.reply_model
        return response

    # -- models ---------------------------------------------------------------------------

    def model_spec(self):
        """--model as given (None: the embedded default)."""
        return getattr(self.settings, "model", self.response_generator.cli_args.model)

    def served_model(self):
        """The id /v1/models lists for the model this server serves."""
        return served_id(self.model_spec())

    def model_names(self):
        """Every name a request may give the served model."""
        return names(self.model_spec(), self.response_generator.cli_args.model)

    def send_models(self, model_id):
        """/v1/models (model_id ""), or /v1/models/{model_id}."""
        started = getattr(self.settings, "started", self.created)
        try:
            if not model_id:
                return self.send_json(model_list(self.served_model(), started))
            self.send_json(find_model(model_id, self.served_model(), started))
        except guard.Refused as e:
            send_error(self, e)

    # -- GET, OPTIONS ---------------------------------------------------------------------

    def do_OPTIONS(self):
        if not self.refused(post=False):
            super().do_OPTIONS()

    def do_GET(self):
        if self.refused(post=False):
            return
        url = urlsplit(self.path)
        if url.path == MODELS_PATH or url.path.startswith(MODELS_PATH + "/"):
            return self.send_models(unquote(url.path[len(MODELS_PATH) + 1 :]))
        if url.path != STATS_PATH:
            return super().do_GET()
        request = parse_qs(url.query).get("request", [None])[-1]
        stats = self.stats.report(request)
        stats.update(
            kv_preset=self.settings.kv_preset,
            kv_sink=self.settings.kv_sink,
            kv_tail_tokens=self.kv_tail_tokens(),
            model=self.response_generator.cli_args.model,
            **self.kv_widths(),
        )
        self.send_json(stats)

    def kv_tail_tokens(self):
        """The tail the KVarN caches keep: --kv-tail-tokens, else make_cache's default for the
        preset (a profile's mix: none; fp16: None, no KVarN cache)."""
        s = self.settings
        if from_settings(s, DEFAULT_PRESET)[0] is not None:
            return s.kv_tail_tokens or 0
        if s.kv_preset == FP16:
            return None
        return user_preset(s.kv_preset, tail_tokens=s.kv_tail_tokens).tail_tokens

    def kv_widths(self):
        """With --kv-profile: the profile and the per-layer widths chosen from it
        (None until the model is loaded)."""
        profile = from_settings(self.settings, DEFAULT_PRESET)
        if profile[0] is None:
            return {}
        model = getattr(getattr(self.response_generator, "model_provider", None), "model", None)
        return {
            "kv_profile": profile[0],
            "kv_widths": None if model is None else profile_mix(model, *profile)[0].summary(),
        }


class PromptRecorder:
    """The response generator as one request's handler sees it: remembers the
    request's prompt tokens under its completion id (KVStats.request_figures)."""

    def __init__(self, generator, stats, request):
        self._generator, self._stats, self._request = generator, stats, request

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate(self, *args, **kwargs):
        ctx, response = self._generator.generate(*args, **kwargs)
        self._stats.remember(self._request, ctx.prompt)
        return ctx, response
