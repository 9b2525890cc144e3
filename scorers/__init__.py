"""Built-in plugins, written only against the public plugin API of `epp.framework`."""

from epp.framework import INFLIGHT_LOAD, PREFIX_MATCH_INFO, PluginRegistry


def register_builtin_plugins(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group for the built-in plugins."""
    from epp.scorers import (
        affinity,
        affinity_filter,
        approx_prefix,
        conformance,
        context_length,
        datalayer_compat,
        disagg,
        inflight,
        label_filters,
        load,
        lora,
        p2p,
        pickers,
        prefix,
        profile_handlers,
        utilization_filter,
    )

    for cls in (
        load.QueueScorer, load.KVCacheUtilizationScorer, load.RunningRequestsSizeScorer,
        load.LoadAwareScorer, load.TokenLoadScorer, lora.LoraAffinityScorer, prefix.PrefixCacheScorer,
        inflight.ActiveRequestScorer, affinity.SessionAffinityScorer, affinity.NoHitLRUScorer,
        pickers.MaxScorePicker, pickers.RandomPicker, pickers.WeightedRandomPicker,
        label_filters.ByLabelFilter, label_filters.LabelSelectorFilter, label_filters.DecodeFilter,
        label_filters.PrefillFilter, profile_handlers.SingleProfileHandler, approx_prefix.GIEApproxPrefixCacheProducer,
        conformance.HeaderBasedTestingFilter, conformance.DestinationEndpointServedVerifier,
        context_length.ContextLengthAware, disagg.DisaggProfileHandler, disagg.PrefixBasedPDDecider,
        disagg.AlwaysDisaggPDDecider, disagg.DataParallelProfileHandler,
        datalayer_compat.MetricsDataSource, datalayer_compat.CoreMetricsExtractor,
        datalayer_compat.EndpointNotificationSource, affinity_filter.PrefixCacheAffinityFilter,
        affinity.SessionAffinityFilter, utilization_filter.UtilizationFilter, profile_handlers.HeaderProfileHandler,
        label_filters.EncodeFilter, disagg.AlwaysDisaggMultimodalDecider, disagg.DisaggHeadersHandler,
        p2p.P2PSourceProducer,
    ):
        registry.register_class(cls)
    registry.register_class(approx_prefix.ApproxPrefixCacheProducer, default_producer_for=[PREFIX_MATCH_INFO])
    registry.register_class(inflight.InflightLoadProducer, default_producer_for=[INFLIGHT_LOAD])
    # Plugins of modules that register themselves, each exporting `register(registry)`.
    from epp.scorers import (
        endpoint_attributes,
        mm_embeddings,
        parsers,
        pd,
        predicted_ttft,
        prefix_home,
        probabilistic_admitter,
        rollout_screener,
        saturation,
        session_routing,
        sessions,
        topology,
    )

    parsers.register(registry)  # one module per request API format (epp.scorers.parsers)
    endpoint_attributes.register(registry)
    mm_embeddings.register(registry)
    topology.register(registry)
    probabilistic_admitter.register(registry)
    rollout_screener.register(registry)
    saturation.register(registry)
    sessions.register(registry)
    session_routing.register(registry)
    prefix_home.register(registry)
    predicted_ttft.register(registry)
    pd.register(registry)
