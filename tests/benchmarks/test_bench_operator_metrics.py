"""The operator benchmark's reading of kube-apiserver's /metrics: two scrapes, what changed between them."""

from __future__ import annotations

from benchmarks.bench_operator import APISERVER_SERIES, _metrics_delta, _window

BEFORE = """\
# TYPE apiserver_watch_events_total counter
apiserver_watch_events_total{group="r3operator.io",resource="rljobs",version="v1alpha1"} 10
apiserver_watch_events_total{group="",resource="nodes",version="v1"} 7
# TYPE apiserver_watch_cache_read_wait_seconds histogram
apiserver_watch_cache_read_wait_seconds_bucket{group="",resource="pods",le="0.005"} 4
apiserver_watch_cache_read_wait_seconds_bucket{group="",resource="pods",le="0.1"} 4
apiserver_watch_cache_read_wait_seconds_bucket{group="",resource="pods",le="1"} 4
apiserver_watch_cache_read_wait_seconds_bucket{group="",resource="pods",le="+Inf"} 4
apiserver_watch_cache_read_wait_seconds_sum{group="",resource="pods"} 0.004
apiserver_watch_cache_read_wait_seconds_count{group="",resource="pods"} 4
# TYPE apiserver_flowcontrol_current_inqueue_requests gauge
apiserver_flowcontrol_current_inqueue_requests{flow_schema="global-default",priority_level="global-default"} 3
# TYPE apiserver_request_total counter
apiserver_request_total{code="201",resource="nodes",verb="CREATE"} 5
"""

AFTER = """\
# TYPE apiserver_watch_events_total counter
apiserver_watch_events_total{group="r3operator.io",resource="rljobs",version="v1alpha1"} 30
apiserver_watch_events_total{group="",resource="nodes",version="v1"} 7
# TYPE apiserver_watch_cache_read_wait_seconds histogram
apiserver_watch_cache_read_wait_seconds_bucket{group="",resource="pods",le="0.005"} 6
apiserver_watch_cache_read_wait_seconds_bucket{group="",resource="pods",le="0.1"} 9
apiserver_watch_cache_read_wait_seconds_bucket{group="",resource="pods",le="1"} 22
apiserver_watch_cache_read_wait_seconds_bucket{group="",resource="pods",le="+Inf"} 24
apiserver_watch_cache_read_wait_seconds_sum{group="",resource="pods"} 10.004
apiserver_watch_cache_read_wait_seconds_count{group="",resource="pods"} 24
# TYPE apiserver_flowcontrol_current_inqueue_requests gauge
apiserver_flowcontrol_current_inqueue_requests{flow_schema="global-default",priority_level="global-default"} 1
# TYPE apiserver_request_total counter
apiserver_request_total{code="201",resource="nodes",verb="CREATE"} 9
"""


def test_counters_are_deltas_and_unchanged_ones_are_left_out() -> None:
    delta = _metrics_delta(BEFORE, AFTER, APISERVER_SERIES)
    assert delta["apiserver_watch_events_total{group=r3operator.io,resource=rljobs,version=v1alpha1}"] == 20
    assert not any(key.startswith("apiserver_watch_events_total{group=,resource=nodes") for key in delta)


def test_a_histogram_is_the_count_mean_and_quantile_buckets_of_the_window() -> None:
    delta = _metrics_delta(BEFORE, AFTER, APISERVER_SERIES)
    # 20 new observations summing to 10 s; cumulative 2, 5, 18, 20: half (10) first reached at le=1, 95 % (19) at +Inf.
    assert delta["apiserver_watch_cache_read_wait_seconds{group=,resource=pods}"] == {
        "count": 20.0,
        "mean_s": 0.5,
        "p50_bucket_le": 1.0,
        "p95_bucket_le": "+Inf",
    }


def test_a_gauge_is_its_value_after_and_node_requests_are_not_kept() -> None:
    delta = _metrics_delta(BEFORE, AFTER, APISERVER_SERIES)
    key = "apiserver_flowcontrol_current_inqueue_requests{flow_schema=global-default,priority_level=global-default}"
    assert delta[key] == 1
    assert not any(key.startswith("apiserver_request_total") for key in delta)


def test_a_window_is_each_process_share_of_a_core_and_the_box_busy_share() -> None:
    def scrape(at: float, text: str, apiserver_s: float, idle: float, user: float) -> dict[str, object]:
        return {
            "at": at,
            "kube-apiserver": text,
            "etcd": "",
            "process_cpu_s": {"kube-apiserver": apiserver_s},
            "system_cpu": {"user": user, "idle": idle, "iowait": 0.0},
            "load_average": [1.0, 1.0, 1.0],
        }

    # 10 s on 2 cores: 20 CPU-seconds, of which 5 idle; the apiserver took 6 of them.
    window = _window(scrape(100.0, BEFORE, 1.0, 50.0, 50.0), scrape(110.0, AFTER, 7.0, 55.0, 65.0))
    assert window["box_cpu_busy_share"] == 0.75
    assert window["process_cpu_share"] == {"kube-apiserver": 0.6}
    assert (
        window["kube-apiserver"]["apiserver_watch_events_total{group=r3operator.io,resource=rljobs,version=v1alpha1}"]
        == 20
    )
