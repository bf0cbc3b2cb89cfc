"""The ``tiergate`` command: ``serve`` (logs as text or JSON lines; SIGTERM drains, see
``gateway.drain``), ``cluster`` (the same tiers on Ray Serve: ``cluster.cli``), ``demo-models`` (a progress bar in a terminal), ``keys`` (managed API keys,
``gateway.keys_cli``) and ``check`` (tiers.yaml read as ``serve`` reads it, and whether its models fit)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gateway import keys_cli
from gateway.auth import ADMIN_ENV, KeyRing, demo_keys
from gateway.config import (KEY_FILE_SUFFIX, Config, ConfigError, check_keys_apart, env_keys, key_variables,
                            load_config, tier_keys)

if TYPE_CHECKING:
    import uvicorn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiergate", description="A tiered inference gateway for one shared GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server")
    serve.add_argument("--config", default="tiers.yaml", help="path to tiers.yaml")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=tcp_port, default=8000, help="1 to 65535")
    serve.add_argument("--demo", action="store_true",
                       help="when no API keys are set, make random ones for this run and print them")
    serve.add_argument("--log-format", choices=["text", "json"], default="text",
                       help="log lines (one per request among them) as plain text or as JSON objects")
    serve.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM; its chain after it)")
    serve.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    models = sub.add_parser("demo-models", help="build the tiny offline demo models")
    models.add_argument("--out", default="demo-models", help="folder to build them in")
    models.add_argument("--seed", type=int, default=0)
    models.add_argument("--force", action="store_true", help="rebuild models that exist")
    keys_cli.add_parser(sub)
    check = sub.add_parser("check", help="read tiers.yaml as serve does: each model's folder, engine, footprint "
                                         "and whether it fits the budget (exit 1 when one cannot be served)")
    check.add_argument("--config", default="tiers.yaml", help="path to tiers.yaml")
    cluster = sub.add_parser("cluster", help="run the same tiers on a Ray cluster, one replica per device "
                                             "(needs tiergate[cluster]; docs/CLUSTER.md)")
    cluster.add_argument("--config", default="tiers.yaml", help="path to tiers.yaml (its cluster: section)")
    cluster.add_argument("--address", default=None,
                         help="a running Ray cluster ('auto', or host:port of its head); default: start one here")
    cluster.add_argument("--demo", action="store_true", help="when no API keys are set, make random ones and print them")
    args = parser.parse_args(argv)
    if args.command == "serve" and bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        serve.error("--ssl-certfile and --ssl-keyfile go together")
    if args.command == "cluster":
        from cluster.cli import run  # imports Ray: only this command does

        return run(args.config, args.address, args.demo)
    if args.command == "keys":
        try:
            config = load_config(args.config, check_paths=False)
            usable_data_dir(config)  # the SQLite store's folder, as serve makes it: a bad one is a line, not SQLite's
        except ConfigError as exc:
            print(f"tiergate: {exc}", file=sys.stderr)
            return 2
        return keys_cli.run(args, config)
    if args.command == "check":
        return _check(args.config)
    if args.command == "demo-models":
        try:  # a folder that cannot be made (a file there, a read-only place) is a line, not pathlib's traceback
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"tiergate: --out {args.out}: cannot make the folder: {exc.strerror or exc}", file=sys.stderr)
            return 2
        for name, folder in _build_demo_models(Path(args.out), args.seed, args.force).items():
            print(f"{name}: {folder}")
        return 0
    from gateway.key_files import drop_hold

    try:
        return _serve(args)
    except KeyboardInterrupt:  # Ctrl+C before uvicorn runs (its imports, the stores): once it runs, a drain
        print("tiergate: stopped while starting (Ctrl+C)", file=sys.stderr)
        return 130
    finally:
        drop_hold()  # SIGHUP as it was where serve ended before its key files' watcher took it


def tcp_port(text: str) -> int:
    """``--port``: 1 to 65535, as ``cluster.port``; the socket call would wrap a larger number
    (70000 listened on 4464), and 0 (a port the system picks) would leave the printed URLs wrong."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: 1 to 65535")
    return port


def _check(config_path: str) -> int:
    """``tiergate check``: the config as ``serve`` reads it, its adapters and webhooks' secrets
    too (2 when it cannot be read), then each
    model's kind, engine, aliases and footprint against the device budget, what the gateway reads
    of its folder before loading it, and whether all fit at once; each tier's key count; 1 when a
    model's folder or a key file cannot be read or a model can never fit. Loads no weights."""
    from arbiter.footprint import configured_device, device_budget
    from arbiter.residency import _estimate
    from gateway.adapters import load_adapters
    from gateway.webhooks import endpoints_of
    from workers.registry import context_over_folder, describe, folder_kind_mismatch

    try:
        config = load_config(config_path)
        adapters = load_adapters(config)
        endpoints_of(config)  # as serve reads them: each secret set and readable, each URL once
        usable_data_dir(config, make=False)  # the SQLite stores' folder, as serve refuses it (nothing made here)
    except ConfigError as exc:
        print(f"tiergate: {exc}", file=sys.stderr)
        return 2
    try:  # as serve reads them, with serve's message: cuda where there is none, no budget on the CPU
        device = configured_device(config.gpu.device)
        budget = device_budget(device, config.gpu.vram_budget, config.gpu.reserve)
    except (ValueError, RuntimeError) as exc:
        print(f"tiergate: {config.source}: gpu: {exc}", file=sys.stderr)
        return 2
    specs = config.model_specs()
    aliases = config.aliases
    folders = f" (and {len(adapters.dirs)} adapter folders, read as requests name them)" if adapters.dirs else ""
    print(f"{config.source}: {len(specs)} models, {len(adapters.adapters)} adapters{folders}; device {device}, "
          f"budget {_size(budget)}{' (gpu.vram_budget)' if config.gpu.vram_budget else ''}")
    print(f"{'model':<24} {'kind':<10} {'engine':<12} {'footprint':>10}  {'from':<9} {'fits':<5} aliases / problem")
    failed, total = 0, 0
    for spec in specs:
        footprint, fits = 0, False
        try:
            footprint = _estimate(spec)  # as the arbiter starts from it: the weights' headers, no load
            fits = footprint <= budget
            describe(spec)  # what the gateway reads of the folder before loading it
            problem = folder_kind_mismatch(spec) or context_over_folder(spec) or \
                ("" if fits else f"never fits: {_size(footprint)} > the budget")
        except Exception as exc:  # noqa: BLE001 - what serve would meet when it reads the folder
            problem = f"its folder cannot be read: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        failed += bool(problem)
        total += footprint
        named = ", ".join(a for a, m in aliases.items() if m == spec.name)
        print(f"{spec.name:<24} {spec.kind:<10} {spec.engine:<12} {_size(footprint):>10}  "
              f"{'declared' if spec.vram is not None else 'estimated':<9} {'yes' if fits else 'NO':<5} {problem or named}")
    together = "every model can be resident at once" if total <= budget else \
        "not all at once: the arbiter loads and evicts them by tier (README, Arbitration)"
    print(f"all models: {_size(total)} of {_size(budget)}: {together}")
    if failed:
        print(f"tiergate: {failed} model(s) cannot be served as configured", file=sys.stderr)
    unreadable = _check_keys(config)
    refused = _check_adapter_folders(adapters)
    if refused:
        print(f"tiergate: {refused} adapter(s) in adapter_dirs cannot be served", file=sys.stderr)
    return 1 if failed or refused or unreadable else 0


def _check_keys(config: Config, environ=os.environ) -> int:
    """How many keys each tier and the admins have, from their variables and the files their
    ``_FILE`` variables name (counts, never keys); how many of those files cannot be read, or 1
    where a key is in two places."""
    counts, tier_keys_seen, unreadable = [], 0, 0
    for name, var in zip([*config.tier_names, "admin"], key_variables(config)):
        try:
            n = len(env_keys(var, environ))
        except ConfigError as exc:
            print(f"tiergate: {exc}", file=sys.stderr)
            unreadable += 1
            continue
        tier_keys_seen += n if name != "admin" else 0
        file = environ.get(var + KEY_FILE_SUFFIX)
        counts.append(f"{name} {n}" + (f" ({var}{KEY_FILE_SUFFIX}: {file})" if file else ""))
    none = "" if tier_keys_seen or unreadable else " (no tier key here: serve needs one, or --demo)"
    print("keys: " + ", ".join(counts) + none)
    if not unreadable:
        try:
            check_keys_apart(config, tier_keys(config, environ), env_keys(ADMIN_ENV, environ), environ)
        except ConfigError as exc:  # serve would refuse them: one key in two places
            print(f"tiergate: {exc}", file=sys.stderr)
            return 1
    return unreadable


def _check_adapter_folders(adapters) -> int:
    """Each ``adapter_dirs`` folder's adapters read and checked as a request would; the problems
    printed, one line each; how many there are."""
    surveyed = adapters.survey()
    for d in adapters.dirs:
        mine = [(name, problem) for folder, name, problem in surveyed if folder is d]
        bad = [(name, problem) for name, problem in mine if problem]
        print(f"adapter folder {d.path} ({d.model}): {len(mine) - len(bad)} adapters serve, {len(bad)} cannot")
        for name, problem in bad:
            print(f"  {name or '(the folder)':<32} {problem}")
    return sum(bool(problem) for _, _, problem in surveyed)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _build_demo_models(out: Path, seed: int, force: bool) -> dict[str, Path]:
    """Every demo model with its adapters, one model at a time under a progress bar (shown in a
    terminal only, as the bars of the libraries that write the weights)."""
    if not sys.stderr.isatty():
        _no_library_bars()
    from tqdm import tqdm

    from demo import DEMO_ADAPTERS, DEMO_MODELS, build_demo_models

    built: dict[str, Path] = {}
    with tqdm(DEMO_MODELS, desc="demo models", unit="model", disable=not sys.stderr.isatty()) as bar:
        for model in bar:
            bar.set_postfix_str(model)
            adapters = [a for a, (base, *_) in DEMO_ADAPTERS.items() if base == model]
            built.update(build_demo_models(out, seed, names=[model, *adapters], force=force))
    return built


def _no_library_bars() -> None:
    """The weight writers' own bars off (transformers' "Writing model shards", diffusers',
    huggingface_hub's): through the environment, which they read as they are imported, since
    importing them here would cost seconds a run that finds every model built has no need of."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # huggingface_hub's; transformers' asks it at import
    os.environ.setdefault("TQDM_DISABLE", "1")  # every other tqdm bar's default: diffusers'


def resolve_keys(config: Config, demo: bool, environ=os.environ) -> tuple[KeyRing, dict[str, list[str]] | None]:
    """The key ring, and the demo keys if they were made up (to print once). Demo mode makes up
    the tier keys, and an admin key only where the environment sets none: an operator's admin
    keys (for the dashboard, say) are kept, and not printed (``admin_source``)."""
    keys = tier_keys(config, environ)
    admin = env_keys(ADMIN_ENV, environ)
    made = None
    if not any(keys.values()):
        if not demo:
            names = ", ".join(t.keys_env for t in config.tiers)
            raise ConfigError(f"{config.source}: tiers: no API keys are set (set {names}, or each with _FILE "
                              "naming a file of keys, or run with --demo)")
        made = demo_keys(config.tier_names + ([] if admin else ["admin"]))
        keys = {tier: made[tier] for tier in config.tier_names}
        admin = admin or made["admin"]
    else:
        check_keys_apart(config, keys, admin, environ)
    return KeyRing(keys, admin), made


def admin_source(environ=os.environ) -> str:
    """Where the environment's admin keys come from, for the demo banner: the variables, never a key."""
    file = environ.get(ADMIN_ENV + KEY_FILE_SUFFIX)
    named = [ADMIN_ENV] if environ.get(ADMIN_ENV, "").strip() else []
    return " and ".join(named + ([f"{ADMIN_ENV}{KEY_FILE_SUFFIX} ({file})"] if file else []))


def usable_data_dir(config: Config, make: bool = True) -> None:
    """``batch.data_dir``, made if missing and written to once, when the SQLite stores live there:
    one that cannot be used is a config error now, not SQLite's traceback from the app's start-up.
    ``make=False`` (``tiergate check``): nothing is made; a missing folder's nearest existing
    folder above it is written to instead (a file made and gone at once)."""
    if config.batch.store != "sqlite":
        return
    import tempfile

    folder = config.data_dir()
    try:
        if make:
            folder.mkdir(parents=True, exist_ok=True)
        probe = folder if make else next(p for p in (folder, *folder.parents) if p.exists())
        with tempfile.TemporaryFile(dir=probe):  # a read-only filesystem lets root make no file either
            pass
    except OSError as exc:
        problem = "it is not a folder" if folder.exists() and not folder.is_dir() else exc.strerror or exc
        raise ConfigError(f"{config.source}: batch.data_dir: {folder} cannot hold the SQLite stores: "
                          f"{problem}") from None


def _serve(args: argparse.Namespace) -> int:
    from gateway import request_log
    from gateway.key_files import hold_hangups, release_hangups, watch_key_files

    hold_hangups()  # a SIGHUP while it starts: key files read again once it runs, or the default then
    request_log.configure(json_lines=args.log_format == "json")
    _library_output(sys.stderr.isatty())
    try:
        config = load_config(args.config)
        keyring, made = resolve_keys(config, args.demo)
        usable_data_dir(config)
    except ConfigError as exc:
        print(f"tiergate: {exc}", file=sys.stderr)
        return 2
    if args.ssl_certfile:  # read now, so a wrong file is one line, not uvicorn's traceback after the models load
        import ssl

        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            print(f"tiergate: --ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}: {exc}", file=sys.stderr)
            return 2
    from gateway.app import build_services, create_app
    from gateway import collector
    from gateway.drain import DrainingServer

    try:
        services = build_services(config, keyring)
    except ConfigError as exc:  # an adapter that cannot be served
        print(f"tiergate: {exc}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as exc:  # a model folder without weights, or the device's budget
        where = "models" if str(exc).startswith("model '") else "gpu"
        print(f"tiergate: {config.source}: {where}: {exc}", file=sys.stderr)
        return 2
    if made or watch_key_files(services) is None:  # keys in files are read again when they change, and on SIGHUP
        release_hangups()
    collector.attach(services)  # the long-lived objects frozen out of the garbage collector's walks
    app = create_app(services)
    scheme = "https" if args.ssl_certfile else "http"
    if made:
        _print_demo_keys(made, args.host, args.port, scheme)
    tls = {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile} if args.ssl_certfile else {}
    # uvicorn logs through the handler configured above; the request log replaces its access log
    config = server_config(app, args.host, args.port, log_config=None, access_log=False, **tls)
    DrainingServer(config, app.state.drain).run()
    return 0


def _library_output(interactive: bool) -> None:
    """transformers' and diffusers' log lines through tiergate's handler (so --log-format json
    holds for them too), and their weight-loading bars (long model loads) in a terminal only: in
    logs they would be noise."""
    import diffusers.utils.logging
    import huggingface_hub.utils
    import transformers.utils.logging

    for library in (transformers.utils.logging, diffusers.utils.logging):
        library.disable_default_handler()
        library.enable_propagation()
        (library.enable_progress_bar if interactive else library.disable_progress_bar)()
    (huggingface_hub.utils.enable_progress_bars if interactive else huggingface_hub.utils.disable_progress_bars)()


def server_config(app, host: str, port: int, log_level: str = "info", **options) -> "uvicorn.Config":
    """uvicorn as tiergate runs it (the tests run the same): httptools with the request head capped
    at ``MAX_HEAD_BYTES``, due within ``limits.head_timeout_s``, and protocol errors in OpenAI's
    shape (gateway/http11.py; the default head timeout for an app without tiergate's services, as
    the benchmarks' bare one). Request bodies are bounded by the app: ``limits.max_body`` and
    ``limits.body_timeout_s``. ``options`` go to uvicorn as they are.

    No ``limit_concurrency``: uvicorn still accepts every connection past it and answers its
    requests 503 (plain text), so it caps no descriptors; it only lets the connections a client
    holds refuse everyone else's requests. The head deadline is what frees held connections."""
    import uvicorn

    from gateway.http11 import HEAD_TIMEOUT_S, GatewayHttpToolsProtocol

    services = getattr(app.state, "services", None)  # (a benchmark's bare app has none: the default)
    protocol = GatewayHttpToolsProtocol.timed(services.config.limits.head_timeout_s if services else HEAD_TIMEOUT_S)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=protocol, **options)


def _print_demo_keys(made: dict[str, list[str]], host: str, port: int, scheme: str = "http") -> None:
    base = f"{scheme}://{host}:{port}/v1"
    print("\ntiergate demo mode: random API keys for this run only", flush=True)
    for tier, keys in made.items():
        print(f"  {tier:<11} {keys[0]}")
    if "admin" not in made:  # the environment's, kept: never printed
        print(f"  {'admin':<11} the environment's admin keys, from {admin_source()} (not made up, not shown)")
    paid = made[next(iter(made))][0]
    print(f"""
Try it:
  curl {base}/chat/completions -H "Authorization: Bearer {paid}" \\
       -H "Content-Type: application/json" \\
       -d '{{"model": "tiny-chat", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16}}'
  OPENAI_BASE_URL={base} OPENAI_API_KEY={paid} python -c "import openai; print(openai.OpenAI().chat.completions.create(model='tiny-chat', messages=[{{'role': 'user', 'content': 'Hello'}}], max_tokens=16).choices[0].message.content)"
""", flush=True)


if __name__ == "__main__":
    sys.exit(main())
