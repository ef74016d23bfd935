"""The dashboard's routes: GET /dashboard (the page), /dashboard/static/<file> (its script and style, from
the package), /dashboard/state (the JSON it polls).

With API keys (--api-keys) the state needs a key, as `Authorization: Bearer <key>` or `?key=<key>`
(401 without one); the page and its files hold no data and are served to anyone.
"""

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.errors import Unauthenticated
from gateway.auth import AUTHORIZATION, BEARER, Tenant
from gateway.http.app import Installer
from gateway.http.dashboard_state import DashboardSource

STATIC = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# NOTE: the page loads nothing but its own files and state (no CDN: a server may have no internet).
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _file(name: str) -> bytes:
    return resources.files("gateway.http").joinpath("static", name).read_bytes()


def viewer(request: Request, source: DashboardSource) -> Tenant | None:
    """The caller's tenant (None without keys); Unauthenticated for a missing or unknown key."""
    if source.keys is None:
        return None
    header = request.headers.get(AUTHORIZATION)
    key = request.query_params.get("key")
    token = header if header is not None else f"{BEARER}{key}" if key is not None else None
    return source.keys.authenticate([(AUTHORIZATION, token)] if token is not None else [])


def installer(source: DashboardSource) -> Installer:
    """Adds the dashboard's routes, serving `source`'s state; the files are read once, here."""
    page = _file("dashboard.html")
    files = {name: (_file(name), media_type) for name, media_type in STATIC.items()}

    def install(app: FastAPI) -> None:
        @app.get("/dashboard", include_in_schema=False)
        def dashboard_page() -> Response:
            return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

        @app.get("/dashboard/static/{name}", include_in_schema=False)
        def dashboard_file(name: str) -> Response:
            if name not in files:
                return JSONResponse({"error": {"message": f"no file {name!r}"}}, 404, headers=HEADERS)
            body, media_type = files[name]
            return Response(body, media_type=media_type, headers=HEADERS)

        @app.get("/dashboard/state", include_in_schema=False)
        def dashboard_state(request: Request) -> Response:
            try:
                tenant = viewer(request, source)
            except Unauthenticated as err:
                body = {"error": {"message": str(err), "type": "authentication_error"}}
                return JSONResponse(body, 401, headers={**HEADERS, "WWW-Authenticate": "Bearer"})
            headers = {**HEADERS, "Cache-Control": "no-store"}
            return JSONResponse(source.state(tenant), headers=headers)

    return install
