// Package configtest checks a config type's table of invalid values for
// the tests of the packages that define configs (optim, onebit): every
// field has a bad case or takes any value, Validate refuses each bad case
// naming the field, the constructor refuses it with the same error, and
// the valid config passes both.
package configtest

import (
	"reflect"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Bad is one invalid value of one field of a config C: Mod sets it.
type Bad[C any] struct {
	Field string
	Mod   func(*C)
}

// FieldOf reads the config and field names an error reports (from an
// *optim.ConfigError in its chain); ok is false when it has none.
type FieldOf func(err error) (config, field string, ok bool)

// Check runs the table cases of config type C named name (with its
// package, e.g. "onebit.AdamConfig"): valid passes validate and build;
// every case is refused by validate with an error that fieldOf reads as
// name and the case's field, and by build with the very same message;
// every field of C that a user sets (promoted ones included) has a case
// or is listed in anyValue.
func Check[C any](t *testing.T, name string, valid C, validate, build func(C) error, fieldOf FieldOf, anyValue []string, cases []Bad[C]) {
	t.Helper()
	require.NoError(t, validate(valid), "%s: the valid config", name)
	require.NoError(t, build(valid), "%s: the valid config", name)
	covered := map[string]bool{}
	for _, f := range anyValue {
		covered[f] = true
	}
	for _, c := range cases {
		covered[c.Field] = true
		cfg := valid
		c.Mod(&cfg)
		verr := validate(cfg)
		require.Error(t, verr, "%s.%s: Validate", name, c.Field)
		config, field, ok := fieldOf(verr)
		require.True(t, ok, "%s.%s: Validate gave %v, which names no config field", name, c.Field, verr)
		assert.Equal(t, name, config, "%s.%s: %v", name, c.Field, verr)
		assert.Equal(t, c.Field, field, "%s.%s: %v", name, c.Field, verr)
		berr := build(cfg)
		require.Error(t, berr, "%s.%s: the constructor", name, c.Field)
		_, bfield, ok := fieldOf(berr)
		require.True(t, ok, "%s.%s: the constructor gave %v, which names no config field", name, c.Field, berr)
		assert.Equal(t, verr.Error(), berr.Error(), "%s.%s: the constructor's error is Validate's", name, c.Field)
		assert.Equal(t, field, bfield, "%s.%s", name, c.Field)
	}
	for _, f := range FieldNames(reflect.TypeOf(valid)) {
		assert.True(t, covered[f], "%s.%s has no bad case and is not listed as taking any value", name, f)
	}
}

// FieldNames returns the names of the fields of struct type t that a user
// sets, promoted fields included, embedded structs themselves excluded.
func FieldNames(t reflect.Type) []string {
	var names []string
	for _, f := range reflect.VisibleFields(t) {
		if f.Anonymous && f.Type.Kind() == reflect.Struct {
			continue
		}
		names = append(names, f.Name)
	}
	return names
}
