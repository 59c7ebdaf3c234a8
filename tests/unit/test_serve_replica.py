import gc

from raylora.serve.replica import _Held


class _Server:
    def __init__(self):
        self.retired: list[str] = []

    def retire(self, name: str) -> None:
        self.retired.append(name)


def test_an_evicted_adapter_is_retired_once_even_when_collected_later():
    # Serve's LRU calls __del__ on eviction and then replaces it on the instance; Python's collector still
    # calls the class's __del__, by which time the adapter may be loaded again: that must not unload it.
    server = _Server()
    held = _Held(server, "alpha")
    held.__del__()
    held.__del__ = lambda *_: None
    del held
    gc.collect()
    assert server.retired == ["alpha"]
