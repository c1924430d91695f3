"""The LoRA adapters an engine serves, by name: loaded at start (`--lora-modules`) or at run time, unloaded at run
time, resolved for each request.

Every served adapter keeps its folder and description; the weights of at most `max_cpu_loras` stay in host memory,
the least recently used going first (read from the folder again when next asked for, under a new key). A request
holds its adapter object, so unloading or evicting one never changes a request already running with it, and its
memory goes when the last such request does. Thread-safe: loads and resolutions read files on worker threads.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

from engine_server.config import LoraConfig, ModelConfig
from engine_server.errors import AdapterExistsError, AdapterNotFoundError, ValidationError
from engine_server.lora.peft_format import LoraAdapter, read_peft_adapter

MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class ServedAdapter:
    """What the engine says of a served adapter (GetModelInfo, the gateway's /v1/models)."""

    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]


class AdapterRegistry:
    """Served adapters by name, with an LRU of their weights in host memory."""

    def __init__(self, config: LoraConfig, model_config: ModelConfig, base_model_id: str) -> None:
        self.config = config
        self.model_config = model_config
        self.base_model_id = base_model_id
        self._lock = threading.Lock()
        self._served: dict[str, ServedAdapter] = {}  # in load order
        self._weights: OrderedDict[str, LoraAdapter] = OrderedDict()  # name -> weights, least recently used first
        self._loads = itertools.count(1)

    @classmethod
    def for_engine(
        cls, config: LoraConfig | None, model_config: ModelConfig, base_model_id: str
    ) -> AdapterRegistry | None:
        """The registry of an engine started with `config` (None: without LoRA), `config.modules` loaded."""
        if config is None:
            return None
        registry = cls(config, model_config, base_model_id)
        for name, path in config.modules:
            registry.load(name, path)
        return registry

    def load(self, name: str, path: str) -> ServedAdapter:
        """Read the adapter in folder `path` and serve it as `name`. ValidationError for a bad name or adapter
        (param "lora_name" / "lora_path"), AdapterExistsError when `name` is served already. Reads files."""
        if not name or len(name) > MAX_NAME_CHARS or name != name.strip():
            raise ValidationError(f"an adapter's name is 1 to {MAX_NAME_CHARS} characters, without surrounding "
                                  "spaces", "lora_name")  # fmt: skip
        if name == self.base_model_id:
            raise ValidationError(f"{name!r} is the base model's id; give the adapter another name", "lora_name")
        with self._lock:
            self._check_free(name)
        adapter = self._read(name, path)
        served = ServedAdapter(name, adapter.path, adapter.rank, adapter.target_modules)
        with self._lock:
            self._check_free(name)  # another load of the name may have finished while this one read
            self._served[name] = served
            self._keep(adapter)
        return served

    def unload(self, name: str) -> None:
        """Stop serving `name` (AdapterNotFoundError when it is not served); running requests keep their copy."""
        with self._lock:
            if self._served.pop(name, None) is None:
                raise AdapterNotFoundError(f"no LoRA adapter named {name!r} is served")
            self._weights.pop(name, None)

    def resolve(self, name: str) -> LoraAdapter:
        """The weights of served adapter `name`, read from its folder again if they were evicted (so call off the
        event loop); AdapterNotFoundError when it is not served."""
        with self._lock:
            served = self._served.get(name)
            if served is None:
                raise AdapterNotFoundError(f"the model {name!r} does not exist: it is neither the served model nor "
                                           "a LoRA adapter loaded on it")  # fmt: skip
            adapter = self._weights.get(name)
            if adapter is not None:
                self._weights.move_to_end(name)
                return adapter
        adapter = self._read(name, served.path)
        with self._lock:
            if self._served.get(name) is served:  # still the same adapter: keep its weights for the next request
                self._keep(adapter)
        return adapter

    def served(self) -> list[ServedAdapter]:
        """Every served adapter, in load order."""
        with self._lock:
            return list(self._served.values())

    @property
    def host_bytes(self) -> int:
        """Host memory the registry's kept weights hold (requests may hold evicted or unloaded ones a while)."""
        with self._lock:
            return sum(adapter.nbytes for adapter in self._weights.values())

    def _read(self, name: str, path: str) -> LoraAdapter:
        key = f"{name}#{next(self._loads)}"
        return read_peft_adapter(path, name, key, self.model_config, self.config.max_lora_rank)

    def _check_free(self, name: str) -> None:
        if name in self._served:
            raise AdapterExistsError(f"a LoRA adapter named {name!r} is served already; unload it first")

    def _keep(self, adapter: LoraAdapter) -> None:
        self._weights[adapter.name] = adapter
        self._weights.move_to_end(adapter.name)
        while len(self._weights) > self.config.max_cpu_loras:
            self._weights.popitem(last=False)
