"""An out-of-tree pluginfer model plugin for IBM Granite."""
