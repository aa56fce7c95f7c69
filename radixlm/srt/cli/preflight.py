"""Checks the command line runs before it starts anything, so that a user's mistake is one
clear line (exit code 2) and not, after seconds of loading, a traceback from a child process.

- the model path: exists, is readable, is a GGUF file or a Hugging Face directory, of an
  architecture radixlm runs (read from its header or config.json: no weights are loaded);
- the HTTP port: free on the host (before the model loads, not after).
"""
from __future__ import annotations

import errno
import os
import socket


class UserError(Exception):
    """A mistake on the command line or in its files: reported as one line, exit code 2."""


def _readable(path: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except PermissionError:
        raise UserError(f"cannot read {path}: permission denied") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory where a file was expected") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def check_model_path(model_path: str | None) -> str:
    """The resolved model path, or UserError saying what is wrong with it."""
    from radixlm.srt.weights.loader import is_gguf, load_model_config, resolve_model_path
    from radixlm.srt.weights.safetensors_loader import weight_files

    try:
        path = resolve_model_path(model_path)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise UserError(f"{path} is not a model: a Hugging Face directory needs config.json "
                            "(or give a .gguf file)")
        _readable(config)
    elif not is_gguf(path):
        raise UserError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    else:
        _readable(path)
    try:
        load_model_config(path)
    except Exception as e:  # only its header or config.json was read: any failure is the file's
        raise UserError(str(e) if path in str(e) else f"cannot load {path}: {e}") from None
    if os.path.isdir(path):
        try:
            files = weight_files(path)
        except (FileNotFoundError, ValueError, KeyError) as e:
            raise UserError(str(e)) from None
        for f in files:
            _readable(f)
    return path


def check_port_free(host: str, port: int) -> None:
    """UserError when `host:port` cannot be bound now (in use, or not an address of this
    machine); the socket is closed again at once. uvicorn binds with SO_REUSEADDR, so this does
    too: a port left in TIME_WAIT is free for both."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"cannot serve on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is already in use (choose another with --port)") from None
            raise UserError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
