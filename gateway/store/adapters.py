"""The LoRA adapters loaded through the gateway (`gateway.adapters.AdapterRegistry`): name and folder, in the
database every gateway replica shares, so any of them can give an engine that comes back the adapters it lost."""

from __future__ import annotations

from sqlalchemy import Engine, delete, insert, select

from gateway.store.tables import lora_adapters


class AdapterStore:
    """Loaded adapters by name. Blocking calls: run them off the event loop."""

    def __init__(self, db: Engine) -> None:
        self.db = db

    def record(self, name: str, path: str, now: int) -> None:
        """`name` is served from folder `path` (replacing what an earlier load of that name recorded)."""
        with self.db.begin() as c:
            c.execute(delete(lora_adapters).where(lora_adapters.c.name == name))
            c.execute(insert(lora_adapters).values(name=name, path=path, loaded_at=now))

    def forget(self, name: str) -> None:
        with self.db.begin() as c:
            c.execute(delete(lora_adapters).where(lora_adapters.c.name == name))

    def loaded(self) -> dict[str, str]:
        """Name -> folder of every recorded adapter, in the order they were loaded."""
        with self.db.connect() as c:
            rows = c.execute(select(lora_adapters.c.name, lora_adapters.c.path).order_by(lora_adapters.c.pk))
            return {name: path for name, path in rows}
