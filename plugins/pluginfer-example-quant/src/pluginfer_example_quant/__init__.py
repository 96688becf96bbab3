"""An out-of-tree pluginfer quant method: rowwise int8 weights with its own kernel op."""
