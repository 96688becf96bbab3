"""Tests of the OpenAI-compatible server (pluginfer/server) against a real server on 127.0.0.1."""
