"""engine/worker.py: the start-up timing of a lazily read checkpoint."""

from __future__ import annotations

from pluginfer.engine.worker import timed_items


def test_timed_items_counts_producing_the_items_not_consuming_them() -> None:
    now = [0.0]  # a clock that moves only when the producer or the consumer says so

    def produce():  # noqa: ANN202
        for item in range(3):
            now[0] += 2.0
            yield item
        now[0] += 1.0  # finding there is nothing more counts too

    spent = [0.0]
    seen = []
    for item in timed_items(produce(), spent, clock=lambda: now[0]):
        seen.append(item)
        now[0] += 5.0  # the consumer's own work
    assert seen == [0, 1, 2]
    assert spent == [7.0]
    assert list(timed_items([], spent, clock=lambda: now[0])) == [] and spent == [7.0]
