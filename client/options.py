"""The flags that the `stoker` CLI and `stoker-gateway` share, named as `stoker-worker` names them.

One setting has one flag and one environment twin in every command (`--bootstrap-servers` /
KAFKA_BOOTSTRAP_SERVERS, `--job-topic` / STOKER_JOB_TOPIC, `--redis-url` / REDIS_URL, `--prefix` /
STOKER_PREFIX); tests/test_config_language.py holds the three commands to that. click shows each option's
help, default and environment variable in --help; a flag given on the command line beats its variable.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any, TypeVar

import click
from stoker.client.client import DEFAULT_BOOTSTRAP, DEFAULT_REDIS_URL

from stoker import schemas

F = TypeVar("F", bound=Callable[..., Any])


def option(*decls: str, env: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """click.option that shows its default and its environment twin in --help."""
    kwargs.setdefault("show_default", True)
    return click.option(*decls, envvar=env, show_envvar=env is not None, **kwargs)


def version() -> str:
    try:
        return metadata.version("stoker")
    except metadata.PackageNotFoundError:  # a plain source tree (PYTHONPATH=.), not installed
        return "0+source"


def version_option(prog: str) -> Callable[[F], F]:
    return click.version_option(version(), "--version", prog_name=prog, message="%(prog)s %(version)s")


def redis_options(f: F) -> F:
    f = option("--prefix", env="STOKER_PREFIX", default=schemas.REDIS_PREFIX, help="Redis key prefix")(f)
    return option("--redis-url", env="REDIS_URL", default=DEFAULT_REDIS_URL, help="Redis URL (rediss:// for TLS)")(f)


def kafka_options(f: F) -> F:
    """--bootstrap-servers and --job-topic, with the CLI's old spellings as hidden aliases (--bootstrap,
    --topic); `resolve_aliases` folds them in."""
    f = option("--topic", "topic_alias", hidden=True, default=None, help="deprecated: --job-topic")(f)
    f = option("--bootstrap", "bootstrap_alias", hidden=True, default=None, help="deprecated: --bootstrap-servers")(f)
    f = option("--job-topic", env="STOKER_JOB_TOPIC", default=schemas.JOBS_TOPIC, help="job topic")(f)
    return option("--bootstrap-servers", env="KAFKA_BOOTSTRAP_SERVERS", default=DEFAULT_BOOTSTRAP,
                  help="Kafka bootstrap servers (host:port,...)")(f)


def resolve_aliases(params: dict[str, Any], prog: str) -> None:
    """Moves a deprecated alias's value onto its new name (the alias wins: it was typed), with a warning."""
    for alias, old, new in (("bootstrap_alias", "--bootstrap", "bootstrap_servers"),
                            ("topic_alias", "--topic", "job_topic")):
        value = params.pop(alias, None)
        if value is not None:
            click.echo(f"{prog}: {old} is deprecated; use --{new.replace('_', '-')}", err=True)
            params[new] = value
