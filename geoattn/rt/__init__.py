"""geoattn.rt"""
