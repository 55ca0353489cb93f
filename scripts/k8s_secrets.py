"""Print the Secrets deploy/k8s reads, with fresh random passwords: nothing secret is committed.

    python3 scripts/k8s_secrets.py trial | kubectl create -n thinkbatch -f -
    python3 scripts/k8s_secrets.py managed --database-url URL --redis-url URL \\
        | kubectl create -n thinkbatch -f -

`trial` makes the passwords of the trial overlay's own PostgreSQL and Redis and the URLs the pods
reach them by; `managed` wraps the URLs of your services. Both make Flower's credentials and
print them on stderr (they are in no log). The Secrets, as one JSON list for kubectl:

* thinkbatch-database: `url`, the PostgreSQL URL the pods and KEDA's PostgreSQL scaler both read
  (so postgresql://, which psycopg and KEDA's pgx both take), and for a trial its `password`;
* thinkbatch-redis: `url` (and for a trial `password`);
* thinkbatch-flower: `basic-auth`, user:password.

Use `kubectl create`, not `apply`: it refuses to overwrite a Secret that exists, and a trial's
PostgreSQL keeps the password it was first started with. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from typing import Any
from urllib.parse import quote
from urllib.parse import urlsplit
from urllib.parse import urlunsplit

# The trial overlay's Services (deploy/k8s/overlays/trial) and its database and user. The URLs
# name them with their namespace: KEDA's operator, which reads the database URL too, runs in a
# namespace of its own.
TRIAL_POSTGRES = "thinkbatch-postgres.{namespace}.svc:5432"
TRIAL_REDIS = "thinkbatch-redis.{namespace}.svc:6379"
TRIAL_DATABASE = "thinkbatch"
POSTGRES_SCHEMES = ("postgresql", "postgres")
REDIS_SCHEMES = ("redis", "rediss")


def password() -> str:
    """32 random bytes, URL-safe: it goes into connection URLs as it is."""
    return secrets.token_urlsafe(32)


def secret(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "thinkbatch"}},
        "type": "Opaque",
        "stringData": data,
    }


def database_url(url: str) -> str:
    """A PostgreSQL URL that thinkbatch (psycopg) and KEDA (pgx) both read: postgresql://.
    SQLAlchemy's driver suffix (postgresql+psycopg://) is dropped: thinkbatch adds it itself
    (thinkbatch/db.py), and pgx does not know it."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]
    if scheme not in POSTGRES_SCHEMES or not parts.hostname:
        raise ValueError("--database-url: a postgresql://USER:PASSWORD@HOST:PORT/DB URL")
    return urlunsplit(parts._replace(scheme="postgresql"))


def redis_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES or not parts.hostname:
        raise ValueError("--redis-url: a redis://:PASSWORD@HOST:PORT/DB URL")
    return url


def trial(namespace: str) -> list[dict[str, Any]]:
    pg, rd = password(), password()
    user = quote(TRIAL_DATABASE)
    postgres = TRIAL_POSTGRES.format(namespace=namespace)
    redis = TRIAL_REDIS.format(namespace=namespace)
    return [
        secret(
            "thinkbatch-database",
            {"password": pg, "url": f"postgresql://{user}:{pg}@{postgres}/{TRIAL_DATABASE}"},
        ),
        secret("thinkbatch-redis", {"password": rd, "url": f"redis://:{rd}@{redis}/0"}),
    ]


def managed(database: str, redis: str) -> list[dict[str, Any]]:
    return [
        secret("thinkbatch-database", {"url": database_url(database)}),
        secret("thinkbatch-redis", {"url": redis_url(redis)}),
    ]


def flower(user: str) -> dict[str, Any]:
    return secret("thinkbatch-flower", {"basic-auth": f"{user}:{password()}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    trial_mode = modes.add_parser("trial", help="for overlays/trial: its own PostgreSQL and Redis")
    trial_mode.add_argument(
        "--namespace", default="thinkbatch", help="the overlay's namespace (thinkbatch)"
    )
    ours = modes.add_parser("managed", help="for overlays/managed: your services' URLs")
    ours.add_argument("--database-url", required=True)
    ours.add_argument("--redis-url", required=True)
    parser.add_argument("--flower-user", default="admin")
    args = parser.parse_args(argv)
    try:
        if args.mode == "trial":
            made = trial(args.namespace)
        else:
            made = managed(args.database_url, args.redis_url)
    except ValueError as error:
        parser.error(str(error))
    made.append(flower(args.flower_user))
    json.dump({"apiVersion": "v1", "kind": "List", "items": made}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    auth = made[-1]["stringData"]["basic-auth"]
    print(f"Flower's basic auth (kept in Secret thinkbatch-flower): {auth}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
