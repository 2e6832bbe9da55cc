"""Which checkpoint the tiers catch up with at a save directory's first save or load: the one
its pointer's text names, through the name mapping the framework's adapter gives
(``DurableTiers.name_of``), never a guessed one."""

from deepspeed_async_ckpt.tiers.durable import DurableTiers


class _Drainer:
    def __init__(self) -> None:
        self.queued: list[tuple[str, str]] = []

    def submit(self, ckpt_dir, pointer, release, *, if_behind=False) -> None:
        self.queued.append((ckpt_dir, pointer.text))


def _tiers_on(save_dir) -> tuple[DurableTiers, _Drainer]:
    tiers = DurableTiers((), rank=0, hold=lambda ckpt_dir: lambda: None, remotes=[])
    drainer = _Drainer()
    tiers.drainers = [drainer]
    return tiers, drainer


def _megatron_dir(tmp_path):
    (tmp_path / "iter_0000050").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("50")
    return str(tmp_path / "latest_checkpointed_iteration.txt")


def test_without_a_name_mapping_the_pointers_text_is_the_checkpoints_name(tmp_path):
    tiers, drainer = _tiers_on(tmp_path)
    (tmp_path / "50").mkdir()
    pointer = _megatron_dir(tmp_path)
    tiers.catch_up(str(tmp_path), pointer)
    assert drainer.queued == [(str(tmp_path / "50"), "50")]  # not iter_0000050, a guess


def test_a_pointer_whose_text_names_no_directory_queues_nothing_without_the_adapters_mapping(tmp_path):
    tiers, drainer = _tiers_on(tmp_path)
    tiers.catch_up(str(tmp_path), _megatron_dir(tmp_path))
    assert drainer.queued == []


def test_the_megatron_adapters_mapping_names_the_trackers_iteration_directory(tmp_path):
    from megatron_adapter.checkpointer import named_by_tracker

    tiers, drainer = _tiers_on(tmp_path)
    tiers.name_of = named_by_tracker
    tiers.catch_up(str(tmp_path), _megatron_dir(tmp_path))
    assert drainer.queued == [(str(tmp_path / "iter_0000050"), "50")]
    assert named_by_tracker("release") == "release"


def test_the_checkpoint_the_save_itself_writes_is_not_queued(tmp_path):
    tiers, drainer = _tiers_on(tmp_path)
    (tmp_path / "step1").mkdir()
    (tmp_path / "latest").write_text("step1")
    tiers.catch_up(str(tmp_path), str(tmp_path / "latest"), saving=str(tmp_path / "step1"))
    assert drainer.queued == []
