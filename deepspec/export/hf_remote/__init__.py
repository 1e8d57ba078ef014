"""Files shipped inside exports for loaders outside deepspec (transformers trust_remote_code); they import only torch and transformers."""
