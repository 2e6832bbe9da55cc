"""The engines and settings the checkpoint benchmark compares, by the names its flags take."""

ENGINES = ("async", "sync", "ds_torch", "ds_decoupled", "dcp_async")
ENGINE_LABELS = {
    "async": "this engine (async)",
    "sync": "this engine (sync)",
    "ds_torch": "DS TorchCheckpointEngine",
    "ds_decoupled": "DS DecoupledCheckpointEngine",
    "dcp_async": "torch DCP async_save (CPU: unpinned, blocking staging; no directory fsync)",
}
SETTINGS = {
    "1rank": {"nproc": 1, "label": "1 rank + spare core (headline)"},
    "2rank": {"nproc": 2, "label": "2 ranks on 2 cores"},
}
