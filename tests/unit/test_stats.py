from fsdp_replay.stats import Demand, PrefetchStats


def test_count_served_counts_each_class_in_the_totals_and_under_its_key():
    stats = PrefetchStats()
    stats.count_served("train", [Demand.hit, Demand.miss, Demand.hit, Demand.resident, Demand.hit])
    stats.count_served(None, [Demand.miss])  # outside any scope: totals only
    stats.count_served("eval", [])
    assert (stats.demands, stats.hits, stats.misses, stats.resident) == (6, 3, 2, 1)
    train = stats.per_key["train"]
    assert (train.demands, train.hits, train.misses, train.resident) == (5, 3, 1, 1)
    assert set(stats.per_key) == {"train"}
