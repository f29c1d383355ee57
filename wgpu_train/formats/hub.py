"""Hugging Face hub ids -> local folders: a model, adapter or dataset given as `org/name[@revision]` is taken
from the hub cache (HF_HUB_CACHE / HF_HOME) without any network access when it is there, else downloaded
(only the files a run reads), saying so; offline, one line naming the command that would download it."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from wgpu_train.errors import ConfigError

log = logging.getLogger("wgpu_train")

_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# what each kind of repository needs on this machine (huggingface_hub allow_patterns)
PATTERNS = {
    "model": ["config.json", "generation_config.json", "model*.safetensors", "*.safetensors.index.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.json", "chat_template.jinja",
              "tokenizer.model", "vocab.json", "merges.txt"],
    "adapter": ["adapter_config.json", "adapter_model.safetensors", "tokenizer*", "special_tokens_map.json",
                "chat_template.*"],
    "dataset": ["*.jsonl", "*.json", "*.parquet", "**/*.jsonl", "**/*.json", "**/*.parquet"],
}
_TRUE = ("1", "true", "yes", "on")


_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".safetensors", ".gguf")


def is_hub_id(text) -> bool:
    """Whether `text` has the shape of a hub id (org/name, optionally @revision) and reads as no local path:
    nothing of that name exists, its first part is no local folder, and it does not end like a data file."""
    if not (isinstance(text, str) and _ID.match(text)) or Path(text).exists():
        return False
    return not Path(text.split("/")[0]).is_dir() and not text.split("@")[0].lower().endswith(_FILE_SUFFIXES)


def split_id(text: str) -> tuple[str, str | None]:
    """'org/name@rev' -> ('org/name', 'rev'); no revision: None (the default branch)."""
    repo, _, revision = text.partition("@")
    return repo, revision or None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> str | None:
    """The hub cache to use, read when called (the library reads its environment once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def resolve(text, kind: str = "model") -> Path:
    """The local folder for --model / --adapter-path / --data: an existing path as it is (a local folder wins,
    as in transformers), a hub id from the cache, else downloaded; anything else as a Path for the caller
    to report."""
    if not is_hub_id(text):
        return Path(text)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import errors as hf_errors
    except ImportError:
        raise ConfigError(f"{text} looks like a Hugging Face hub id, which needs the huggingface_hub package "
                          "(pip install huggingface_hub); or give a local folder") from None
    repo, revision = split_id(text)
    repo_type = "dataset" if kind == "dataset" else "model"
    kw = dict(repo_id=repo, revision=revision, repo_type=repo_type, allow_patterns=PATTERNS[kind],
              cache_dir=cache_dir())
    command = f"hf download {repo}" + (" --repo-type dataset" if kind == "dataset" else "") + (
        f" --revision {revision}" if revision else "")
    try:
        return Path(snapshot_download(local_files_only=True, **kw))
    except hf_errors.HFValidationError as e:
        raise ConfigError(f"{text}: not a valid Hugging Face hub id, and no local file or folder ({e})") from None
    except (hf_errors.LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    if offline():
        raise ConfigError(f"{text} is no local file or folder, nor in the Hugging Face cache, and HF_HUB_OFFLINE "
                          f"is set; if it is a hub id, download it first with: {command}")
    log.warning("wgpu-train: downloading %s %s from the Hugging Face hub (%s)", kind, text,
                "config, weights and tokenizer" if kind == "model" else "its files")
    try:
        return Path(snapshot_download(**kw))
    except hf_errors.RevisionNotFoundError:
        raise ConfigError(f"{text}: the hub has no revision {revision!r} of {repo}") from None
    except hf_errors.RepositoryNotFoundError:
        raise ConfigError(f"{text}: no such {repo_type} on the Hugging Face hub (or it is private: "
                          "log in with `hf auth login`)") from None
    except (hf_errors.HfHubHTTPError, hf_errors.OfflineModeIsEnabled, OSError) as e:
        raise ConfigError(f"{text} is no local file or folder, nor in the Hugging Face cache, and the hub cannot "
                          f"be reached ({type(e).__name__}); if it is a hub id, download it with: {command}") from None
