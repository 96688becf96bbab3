"""pluginfer device plugin for Enflame GCUs (``torch_gcu``): the ``gcu`` backend and the ``eccl`` collective."""
