"""Registration only: what this plugin provides and where its factories live."""

from pluginfer.core.hookspecs import EndpointSpec, RequestProcessorSpec, hookimpl


@hookimpl
def pluginfer_endpoints() -> list[EndpointSpec]:
    return [EndpointSpec(name="echo-tokens", factory="pluginfer_example_endpoint.echo:attach",
                         description="POST /v1/example/echo-tokens: token ids, pieces, greedy continuation")]


@hookimpl
def pluginfer_request_processors() -> list[RequestProcessorSpec]:
    return [RequestProcessorSpec(name="shout", factory="pluginfer_example_endpoint.shout:build",
                                 description="at most 16 tokens, <blocked> refused, answers in capitals")]
