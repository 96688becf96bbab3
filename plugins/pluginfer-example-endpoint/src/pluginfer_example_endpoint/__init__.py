"""An HTTP endpoint (``echo-tokens``) and a request processor (``shout``) for pluginfer's server."""
